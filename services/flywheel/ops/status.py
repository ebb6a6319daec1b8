"""The operator's view of a running Flywheel: `flywheel status` and the stream gauges.

`collect_status()` asks the live system, never a cache: each service's health endpoint, Redis
for every stream's length and each consumer group's lag and pending entries (XINFO GROUPS), the
dead-letter stream's length, what is kept (`streams.retention`, `gateway.session_ttl_s`, each
stream's oldest entry age and entries trimmed), each fleet engine's source, state and served
weight version (`/model_info`, SGLang and the embedded engine alike; "default" reads as 0) and
the trainer's `/status` (step, last reward and loss). `render()` turns it into one rich screen.
The stream numbers come from flywheel.core.stream_stats, which the gateway also exports as
Prometheus gauges.

To show another service: add it to `service_targets()` with its health URL.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import httpx
import redis

from flywheel.core.settings import FlywheelSettings, mask_secrets
from flywheel.core.stream_stats import StreamStat, stream_stats

log = logging.getLogger(__name__)

BIND_ALL = ("0.0.0.0", "::", "[::]")
# ---------------------------------------------------------------- services


@dataclass
class ServiceHealth:
    name: str
    target: str
    healthy: bool
    detail: str
    slow: bool = False
    """It accepted the connection but did not answer in time (busy, e.g. an engine under
    load): shown as "slow", not DOWN, and not out of service for the exit code."""


def http_error_words(exc: httpx.HTTPError, timeout_s: float) -> str:
    """What went wrong with a request, in words rather than the exception's class name."""
    text = str(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        return f"no connection within {timeout_s:g} s"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:g} s (busy?)"
    if isinstance(exc, httpx.ConnectError):
        if "refused" in text.lower():
            return "connection refused"
        if "name or service not known" in text.lower() or "nodename" in text.lower():
            return "host not found"
        return f"cannot connect ({text or 'no reason given'})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "closed the connection without an answer"
    return f"request failed ({text or 'no reason given'})"


def service_targets(
    settings: FlywheelSettings, state: dict[str, str] | None = None
) -> list[tuple[str, str, str]]:
    """(name, kind, target) of each service to probe: kind `http` (target = health URL) or
    `grpc` (host:port). `state` = the running local stack's URLs (`stack.json`), which take
    priority over the configured addresses."""
    state = state or {}

    def url(name: str, default: str) -> str:
        return state.get(name, default).rstrip("/")

    def host(name: str, bound: str) -> str:
        # A service bound to every interface (containers) is reached by its service name, which
        # is the section name in docker-compose.yml and the Kubernetes manifests.
        return name if bound in BIND_ALL else bound

    s = settings
    local = f"http://{host('engine', s.engine.host)}:{s.engine.port}"
    engine = s.engine.urls[0] if s.engine.urls else local  # attached: the first engine.urls
    targets = [
        ("engine", "http", url("engine", engine) + "/health"),
        (
            "gateway",
            "http",
            url("gateway", f"http://{host('gateway', s.gateway.host)}:{s.gateway.port}")
            + "/readyz",
        ),
        ("reward", "grpc", url("reward", f"{host('reward', s.reward.host)}:{s.reward.port}")),
    ]
    if s.teacher.enabled or "teacher" in state:
        targets.append(
            (
                "teacher",
                "grpc",
                url("teacher", f"{host('teacher', s.teacher.host)}:{s.teacher.port}"),
            )
        )
        for i, engine in enumerate(_teacher_engines(settings, state)):
            targets.append((f"teacher-engine{'' if i == 0 else i}", "http", f"{engine}/health"))
    targets.append(
        (
            "trainer",
            "http",
            url("trainer", f"http://{host('trainer', s.trainer.host)}:{s.trainer.port}")
            + "/readyz",
        )
    )
    return [(n, k, t.removeprefix("grpc://")) for n, k, t in targets]


def _teacher_engines(settings: FlywheelSettings, state: dict[str, str]) -> list[str]:
    """The teacher's own engines (the local stack's `teacher-engine`, or teacher.engine_urls);
    none for a self-teacher, which scores on the policy engines."""
    t = settings.teacher
    if "teacher-engine" in state:
        return [state["teacher-engine"].rstrip("/")]
    if t.self_teacher:
        return []
    return [u.rstrip("/") for u in t.engine_urls] or [
        f"http://{settings.engine.host}:{t.engine_port}"
    ]


def probe(name: str, kind: str, target: str, timeout_s: float = 3.0) -> ServiceHealth:
    """One health check: HTTP 200, or grpc.health.v1 SERVING."""
    if kind == "grpc":
        try:
            import grpc  # noqa: PLC0415  (only the CLI needs grpc here)
            from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415
        except ImportError:  # an image without the grpc extra (gateway, engine, trainer)
            return ServiceHealth(name, target, False, "unknown: grpcio is not installed here")

        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
                )
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    words = f"no answer within {timeout_s:g} s (busy?)"
                    return ServiceHealth(name, target, False, words, slow=True)
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return ServiceHealth(name, target, False, "not reachable (not listening?)")
                return ServiceHealth(name, target, False, exc.code().name)
        ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        return ServiceHealth(
            name, target, ok, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        )
    try:
        r = httpx.get(target, timeout=timeout_s)
    except httpx.HTTPError as exc:
        slow = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
        return ServiceHealth(name, target, False, http_error_words(exc, timeout_s), slow=slow)
    return ServiceHealth(name, target, r.status_code == 200, f"HTTP {r.status_code}")


def engine_weight_version(base_url: str, timeout_s: float = 3.0) -> int | None:
    """The weight version an engine serves, in the trainer's numbering (`/model_info`, or
    `/get_model_info` on older SGLang; SGLang's initial label "default" is 0, as `flywheel
    engines list` shows it); None when the engine does not answer."""
    version = served_weight_version(base_url, timeout_s)
    return None if isinstance(version, str) else version


def served_weight_version(base_url: str, timeout_s: float = 3.0) -> int | None | str:
    """`engine_weight_version`, or "slow" when the engine accepted the connection but did not
    answer within `timeout_s` (busy)."""
    from flywheel.core.versions import parse_weight_version  # noqa: PLC0415

    for path in ("/model_info", "/get_model_info"):
        try:
            r = httpx.get(base_url.rstrip("/") + path, timeout=timeout_s)
        except httpx.ConnectTimeout:
            return None
        except httpx.TimeoutException:
            return "slow"
        except httpx.HTTPError:
            return None
        if r.status_code == 200:
            try:
                return parse_weight_version(r.json().get("weight_version"))
            except (ValueError, AttributeError):
                return None
    return None


def engine_state(version: int | str | None, fleet_version: int) -> str:
    """An engine's state as far as the CLI can tell: `down` (no answer), `slow` (connected but
    no answer in time: busy), `pending` (serves an
    older version than the fleet's: a joined or restarted engine is routed no request until the
    trainer pushes it the fleet's weights; one in service shows so briefly while a push reaches
    it) or `in_service`."""
    if version is None:
        return "down"
    if isinstance(version, str):
        return "slow"
    return "pending" if version < fleet_version else "in_service"


def trainer_status(base_url: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
    try:
        r = httpx.get(base_url.rstrip("/") + "/status", timeout=timeout_s)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


# ---------------------------------------------------------------- the report


@dataclass
class StatusReport:
    services: list[ServiceHealth]
    redis_url: str
    redis_ok: bool
    redis_error: str
    streams: list[StreamStat]
    engines: list[dict[str, Any]]
    """Each engine of the fleet (and the configured ones): `url`, `source` (static, dns, admin;
    "configured" when not in the fleet), `state` (`engine_state`) and `weight_version` (None =
    no answer)."""
    trainer: dict[str, Any] | None
    retention: str = ""
    """`streams.retention` (consumed entries older than this are trimmed)."""
    session_ttl_s: int = 0
    """`gateway.session_ttl_s` (an idle session record expires after it)."""
    fleet_version: int = 0
    """The fleet's weight version (`{prefix}:fleet:version`, docs/fleet.md)."""
    moved_ports: dict[str, Any] = field(default_factory=dict)
    """Services of the running `flywheel up` that did not get their configured port:
    `{name: {"configured": 8000, "port": 8001}}` (`stack.json`)."""

    @property
    def dead_letters(self) -> int:
        return sum(s.length for s in self.streams if s.name == "dead")

    @property
    def healthy(self) -> bool:
        """Redis and every service answer (or are only slow to), and an engine is in service
        (or only slow to answer)."""
        return (
            self.redis_ok
            and all(s.healthy or s.slow for s in self.services)
            and any(e["state"] in ("in_service", "slow") for e in self.engines)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "redis": {
                "url": mask_secrets(self.redis_url),
                "ok": self.redis_ok,
                "error": self.redis_error,
            },
            "services": [asdict(s) for s in self.services],
            "streams": [asdict(s) for s in self.streams],
            "dead_letters": self.dead_letters,
            "engines": self.engines,
            "fleet_weight_version": self.fleet_version,
            "trainer": self.trainer,
            "retention": {"streams": self.retention, "session_ttl_s": self.session_ttl_s},
            "moved_ports": self.moved_ports,
        }


def collect_status(settings: FlywheelSettings, state: dict[str, str] | None = None) -> StatusReport:
    """Probe everything once (a few seconds at most: every call has a 3 s timeout)."""
    from flywheel.core.fleet import Fleet  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415

    state = state or {}
    redis_url = state.get("redis_url") or settings.redis_url()
    services = [probe(*t) for t in service_targets(settings, state)]
    streams: list[StreamStat] = []
    redis_ok, redis_error = True, ""
    configured = [state["engine"]] if "engine" in state else settings.engine_urls()
    sources = {u.rstrip("/"): "configured" for u in configured}
    fleet_version = 0
    try:
        client = connect(redis_url)
        streams = stream_stats(client, settings.streams)
        fleet = Fleet(client, settings.streams.prefix, [])  # docs/fleet.md
        members = fleet.members()
        fleet_version = fleet.version()
        if members:  # the fleet is what the gateways route over; configured ones not in it
            sources = members  # were removed
    except redis.RedisError as exc:
        redis_ok, redis_error = False, str(exc)
    engines = []
    for url, source in sources.items():
        version = served_weight_version(url)
        engines.append(
            {
                "url": url,
                "source": source,
                "state": engine_state(version, fleet_version),
                "weight_version": None if isinstance(version, str) else version,
            }
        )
    trainer_host = settings.trainer.host
    if trainer_host in BIND_ALL:
        trainer_host = "trainer"
    trainer_url = state.get("trainer", f"http://{trainer_host}:{settings.trainer.port}")
    return StatusReport(
        services,
        redis_url,
        redis_ok,
        redis_error,
        streams,
        engines,
        trainer_status(trainer_url),
        settings.streams.retention,
        settings.gateway.session_ttl_s,
        fleet_version,
        moved if isinstance(moved := cast(Any, state.get("moved_ports")), dict) else {},
    )


# ---------------------------------------------------------------- the screen


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "-" if value is None else str(value)


def _age(seconds: float | None) -> str:
    """An age as the largest whole unit: 42 s, 5 m, 3 h, 2 d ("-" = none)."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def render(report: StatusReport) -> Any:
    """One rich renderable: services, streams and groups, engines, trainer."""
    from rich.console import Group  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    ok, bad = Text("healthy", style="green"), Text("DOWN", style="bold red")
    slow = Text("slow", style="yellow")
    services = Table(title="services", title_justify="left", expand=False)
    for col in ("service", "address", "health", "detail"):
        services.add_column(col)
    services.add_row(
        "redis",
        mask_secrets(report.redis_url),
        ok if report.redis_ok else bad,
        report.redis_error or "PING",
    )
    for s in report.services:
        services.add_row(s.name, s.target, ok if s.healthy else slow if s.slow else bad, s.detail)

    streams = Table(title="streams", title_justify="left")
    for col in ("stream", "length", "group", "consumers", "lag", "pending"):
        streams.add_column(col, justify="right" if col not in ("stream", "group") else "left")
    for stat in report.streams:
        if not stat.groups:
            streams.add_row(stat.key, str(stat.length), "-", "-", "-", "-")
        for i, g in enumerate(stat.groups):
            lag = "?" if g.lag is None else f"{g.lag}{'+' if g.lag_capped else ''}"
            streams.add_row(
                stat.key if i == 0 else "",
                str(stat.length) if i == 0 else "",
                g.group,
                str(g.consumers),
                Text(lag, style="yellow" if g.lag else ""),
                str(g.pending),
            )
    retention = Text(
        f"retention: consumed entries older than {report.retention or '-'} are trimmed (never "
        f"one pending or unread); idle session records expire after {report.session_ttl_s} s"
    )
    kept = Table(title="kept", title_justify="left")
    for col in ("stream", "oldest entry", "trimmed"):
        kept.add_column(col, justify="left" if col == "stream" else "right")
    for stat in report.streams:
        kept.add_row(stat.key, _age(stat.oldest_age_s), str(stat.trimmed))
    dead = Text(
        f"dead letters: {report.dead_letters}", style="bold red" if report.dead_letters else "green"
    )

    engines = Table(
        title=f"engines (fleet weight version {report.fleet_version})", title_justify="left"
    )
    for col in ("engine", "source", "state", "weight version"):
        engines.add_column(col, justify="right" if col == "weight version" else "left")
    styles = {"in_service": "green", "pending": "yellow", "slow": "yellow", "down": "bold red"}
    for e in report.engines:
        version = e["weight_version"]
        engines.add_row(
            e["url"],
            e["source"],
            Text(e["state"], style=styles.get(e["state"], "")),
            "no answer in time"
            if e["state"] == "slow"
            else "no answer"
            if version is None
            else str(version),
        )
    if not report.engines:
        engines.add_row("-", "-", Text("no engine in the fleet", style="bold red"), "-")

    t = report.trainer
    if t is None:
        trainer = Text("trainer: no answer from /status", style="bold red")
    else:
        m = t.get("last_metrics") or {}
        trainer = Text(
            f"trainer: step {t.get('step')}  weight version {t.get('weight_version')}  "
            f"samples trained {t.get('samples_trained')}  last reward "
            f"{_fmt(m.get('reward/mean'))}  loss {_fmt(m.get('loss/pg'))}  "
            f"steps skipped {t.get('steps_skipped')}  dropped {t.get('samples_dropped') or {}}"
        )
    moved = [
        Text(
            f"WARNING: {name} runs on port {p.get('port')}, not its configured port "
            f"{p.get('configured')} (taken when the stack started); clients must use the "
            "address above.",
            style="bold yellow",
        )
        for name, p in report.moved_ports.items()
        if isinstance(p, dict)
    ]
    return Group(services, *moved, streams, retention, kept, dead, engines, trainer)
