"""The local stack behind `flywheel up`: every service as its own process, health-gated.

Order: Redis (a real server, or `FLYWHEEL_REDIS__URL`) -> model conversion (once, cached) ->
engine -> (teacher engine) -> gateway -> reward -> (teacher, when enabled) -> trainer. Each child
reads the resolved settings (ports moved to free ones, the Redis URL, the model path) from
`<state_dir>/settings.json` via `FLYWHEEL_CONFIG`,
logs to `<state_dir>/logs/<service>.log` (appended; messages quote only the current run's
lines), and is stopped in reverse order (SIGTERM, then SIGKILL after a grace period; the trainer
first, waited for, so its last push still finds the engines serving). Start-up
fails fast, with the reason, when an external Redis does not answer a ping or a service reports
a state it cannot recover from (an engine whose model failed to load). The stack's own Redis is
started again if it dies (`revive_redis`), and a service whose process exits is started again
(`revive`), both by `flywheel up`'s watch loop (ops/up.py, `[supervise]` limits the restarts).

Two stacks started at the same instant never mix: a stack holds an exclusive lock on
`<state_dir>/stack.lock` while it runs (a second stack on that state dir fails at once), holds
its ports (`reserve_port`: another stack picks others) until it stops, and counts a service
healthy only when its health endpoint answers from that service's own process (the listening
socket belongs to the child or its descendants, read from /proc where there is one; the gateway
also reports the stack's instance nonce, `FLYWHEEL_INSTANCE`, on `/readyz`).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.core.children import own_session
from flywheel.core.config_files import mask_secrets
from flywheel.core.errors import ConfigurationError, ConflictError, UpstreamError
from flywheel.core.redis_server import LocalRedis, PortReservation, reserve_port
from flywheel.core.settings import FlywheelSettings
from flywheel.ops.engine_launch import (
    ENGINE_SERVICES,
    check_server,
    policy_engine,
    teacher_engine,
    wait_attached,
)
from flywheel.ops.service import (  # noqa: F401  (`listens` re-exported for callers)
    Service,
    auth_off_warning,
    grpc_ok,
    http_ok,
    instance_ok,
    listens,
    port_of,
)

STATE_FILE = "stack.json"
"""File in the state dir that tells `flywheel demo`/`status` where a running stack listens."""
LOCK_FILE = "stack.lock"
"""File in the state dir a running (or starting) stack holds an exclusive lock on."""
SERVICES = ("engine", "teacher-engine", "gateway", "reward", "teacher", "trainer")
STARTING_PROGRESS_S = 15.0
"""Seconds between the `<service> still starting (N s ...)` lines while one loads (a trainer or
engine loading its model takes tens of seconds on a busy CPU)."""


class StackBusyError(ConflictError):
    """Another stack is running or starting from the same state dir."""


@dataclass
class Stack:
    """Start and stop the local stack. `with Stack(settings) as s:` starts it and waits for health.

    Args:
        settings: resolved settings; ports are moved to the next free port when busy.
        config_file: the TOML file `settings` came from (shown in messages only).
        echo: called with one progress line per event (e.g. `print`).
    """

    settings: FlywheelSettings
    config_file: str | None = None
    echo: Callable[[str], None] = print
    services: list[Service] = field(default_factory=list)
    redis: LocalRedis | None = None
    env: dict[str, str] = field(default_factory=dict)
    only: tuple[str, ...] = ()
    """Start only these services (names in `SERVICES`; Redis is always started); empty = all."""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This stack's nonce, given to every child as `FLYWHEEL_INSTANCE`."""
    ports: list[PortReservation] = field(default_factory=list)
    moved: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(configured port, port it got) of each service whose configured port was taken."""
    _lock_fd: int | None = None

    @property
    def state_dir(self) -> Path:
        return Path(self.settings.state_dir)

    def start(self, startup_timeout_s: float | None = None) -> Stack:
        """Start every service and wait for each to be healthy (at most `startup_timeout_s`
        each; None = `engine.startup_timeout_s` for engines, 600 s for the others). With
        `engine.backend = "external"` no engine is started: the stack waits for `engine.urls`.

        Raises:
            StackBusyError: another stack runs or starts from the same state dir.
            ConfigurationError: `only` names an unknown service, or the teacher would need an
                engine of its own with backend "external".
            UpstreamError: the external Redis (`redis.url`) does not answer a ping.
            RuntimeError: a service exited during start-up, or reported that it never will be
                healthy (the message names it, the reason and its log tail).
            TimeoutError: one never got healthy.
        """
        s = self.settings
        unknown = set(self.only) - set(SERVICES)
        if unknown:
            raise ConfigurationError(f"unknown services {sorted(unknown)}; known: {SERVICES}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        (self.state_dir / "logs").mkdir(exist_ok=True)
        # Children read exactly the resolved settings (file + environment, ports moved to free
        # ones) from one JSON file; other FLYWHEEL_<SECTION>__ variables would override it.
        self.env = {
            k: v for k, v in os.environ.items() if "__" not in k or not k.startswith("FLYWHEEL_")
        }
        self.env["FLYWHEEL_INSTANCE"] = self.instance
        if not s.redis.url:
            self.redis = LocalRedis(
                self.state_dir / "redis", port=self._port(s.redis.port, "redis")
            )
            self.redis.start()
            s.redis.url = self.redis.url
            self.echo(f"redis     {self.redis.url}  (local redis-server, AOF on)")
        else:
            self._ping_redis(s.redis.url)
        self._prepare_model()
        attach = s.engine.backend == "external"  # no engine of its own: no engine port
        for section in ("gateway", "trainer") if attach else ("engine", "gateway", "trainer"):
            sec = getattr(s, section)
            sec.port = self._port(sec.port, section)
        s.reward.port = self._port(s.reward.port, "reward")
        s.reward.metrics_port = self._port(s.reward.metrics_port, "reward metrics")
        teacher_engines = self._teacher_ports()
        # Left at their defaults, the trainer's files live in this stack's state dir, so two
        # stacks with different state dirs never share (or resume from) each other's checkpoints.
        defaults = type(s.trainer)()
        if s.trainer.checkpoint.dir == defaults.checkpoint.dir:
            s.trainer.checkpoint.dir = str(self.state_dir / "checkpoints")
        if s.trainer.logging.metrics_path == defaults.logging.metrics_path:
            s.trainer.logging.metrics_path = str(self.state_dir / "trainer_metrics.jsonl")
        s.trainer.checkpoint.dir = str(Path(s.trainer.checkpoint.dir).resolve())
        s.trainer.logging.metrics_path = str(Path(s.trainer.logging.metrics_path).resolve())
        resolved = self.state_dir / "settings.json"
        resolved.write_text(json.dumps(s.model_dump(mode="json"), indent=2))
        self.env["FLYWHEEL_CONFIG"] = str(resolved.resolve())
        if not self.only or "trainer" in self.only:
            self._check_trainer_settings()
        gateway_url = f"http://{s.gateway.host}:{s.gateway.port}"
        trainer_url = f"http://{s.trainer.host}:{s.trainer.port}"
        reward_target = f"{s.reward.host}:{s.reward.port}"
        plan = [
            *filter(None, [policy_engine(s)]),
            *teacher_engines,
            Service(
                "gateway",
                gateway_url,
                "flywheel.gateway",
                instance_ok(f"{gateway_url}/readyz", self.instance),
            ),
            Service("reward", f"grpc://{reward_target}", "flywheel.reward", grpc_ok(reward_target)),
            *self._teacher_service(),
            Service("trainer", trainer_url, "flywheel.trainer", http_ok(f"{trainer_url}/readyz")),
        ]
        if s.engine.backend == "external" and (not self.only or "engine" in self.only):
            try:
                timeout = startup_timeout_s or s.engine.startup_timeout_s
                wait_attached(s.engine.urls, s.engine, timeout, self.echo)
            except (TimeoutError, ConfigurationError):
                self.stop()
                raise
        for service in plan:
            if self.only and service.name not in self.only:
                continue
            self._launch(service)
            engine = service.name in ENGINE_SERVICES
            self._wait_healthy(
                service, startup_timeout_s or (s.engine.startup_timeout_s if engine else 600.0)
            )
            if service.command:  # a launched SGLang: sglang_args may change what it runs
                self._check_server(service)
            if service.name == "gateway" and (
                warning := auth_off_warning(gateway_url, s.gateway.security.auth)
            ):
                self.echo(warning)
        self._write_state()
        return self

    def _check_server(self, service: Service) -> None:
        """`check_server` on a launched engine; stops the stack when it refuses it.

        Raises:
            ConfigurationError: the engine runs with arguments Flywheel cannot work with.
        """
        try:
            check_server(service.url, self.settings.engine)
        except ConfigurationError:
            self.stop()
            raise

    def _lock_state_dir(self) -> None:
        """Hold `<state_dir>/stack.lock` until `stop` (released by the OS if this process dies).

        Raises:
            StackBusyError: another process holds it.
        """
        if self._lock_fd is not None:
            return
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StackBusyError(
                f"a stack is already running or starting from {self.state_dir}; stop it first "
                f"(`{down_command(str(self.settings.state_dir))}` once it is up, or Ctrl-C where "
                "it runs) or use another state_dir"
            ) from None
        self._lock_fd = fd

    def _port(self, preferred: int, name: str = "") -> int:
        """`preferred` or the next port above it that no other stack holds; held until stop.
        A move of `name`'s port is recorded in `moved`."""
        reservation = reserve_port(preferred)
        self.ports.append(reservation)
        if name and preferred and reservation.port != preferred:
            self.moved[name] = (preferred, reservation.port)
        return reservation.port

    def _ping_redis(self, url: str) -> None:
        """Fail at once, before any service starts, when the external Redis does not answer.

        Raises:
            UpstreamError: no PONG (refused, unknown host, wrong password, timeout).
        """
        import redis  # noqa: PLC0415

        from flywheel.core.redis_client import connect  # noqa: PLC0415

        shown = mask_secrets(url)
        client = connect(url)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise UpstreamError(
                f"Redis at {shown} does not answer ({exc}); start it, or fix [redis] url "
                "(FLYWHEEL_REDIS__URL; empty = `flywheel up` starts a local redis-server)"
            ) from None
        finally:
            client.close()
        self.echo(f"redis     {shown}  (external, answers)")

    def _teacher_ports(self) -> list[Service]:
        """Free ports for the teacher (when enabled) and its own engine process, which serves a
        frozen copy of `teacher.model_path` (default: the policy's base model) and is not among
        the engines the trainer pushes weights to. None with `engine_urls` or `self_teacher`."""
        s = self.settings
        t, e = s.teacher, s.engine
        if not t.enabled:
            return []
        # Ports given to services that have not bound them yet are not free for the teacher.
        taken = {e.port, s.gateway.port, s.trainer.port, s.reward.port, s.reward.metrics_port}

        def pick(configured: int, name: str) -> int:
            port = self._port(configured)
            while port in taken:
                port = self._port(port + 1)
            taken.add(port)
            if port != configured:
                self.moved[name] = (configured, port)
            return port

        t.port = pick(t.port, "teacher")
        if t.metrics_port:
            t.metrics_port = pick(t.metrics_port, "teacher metrics")
        if t.engine_urls or t.self_teacher:
            return []
        t.engine_port = pick(t.engine_port, "teacher-engine")
        return [teacher_engine(s, t.engine_port)]

    def _teacher_service(self) -> list[Service]:
        t = self.settings.teacher
        target = f"{t.host}:{t.port}"
        return (
            [Service("teacher", f"grpc://{target}", "flywheel.teacher", grpc_ok(target))]
            if t.enabled
            else []
        )

    def _prepare_model(self) -> None:
        s = self.settings
        if s.engine.model_path:
            return
        from flywheel.core.paths import default_model_dir  # noqa: PLC0415

        target = default_model_dir()
        if not (target / "config.json").exists():
            self.echo(f"model     converting SmolLM2-135M-Instruct GGUF -> {target} (once)")
            subprocess.run(
                [sys.executable, "-m", "flywheel.engine.convert"], check=True, env=self.env
            )
        s.engine.model_path = str(target)

    def _launch(self, service: Service) -> None:
        service.log_path = self.state_dir / "logs" / f"{service.name}.log"
        log = open(service.log_path, "ab")  # noqa: SIM115  (owned by the child)
        service.log_offset = log.seek(0, os.SEEK_END)  # earlier runs' lines end here
        try:
            service.proc = subprocess.Popen(
                service.argv(sys.executable),
                env={**self.env, **service.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                **own_session(),  # Ctrl-C reaches the command only; it stops this child
            )
        except OSError as exc:  # e.g. an `engine.sglang_launcher` that is not there
            log.close()
            raise ConfigurationError(
                f"cannot start {service.name} ({' '.join(service.argv(sys.executable))}): "
                f"{exc}{f'; {service.fix}' if service.fix else ''}"
            ) from None
        self.services.append(service)

    def _wait_healthy(self, service: Service, timeout_s: float) -> None:
        """Wait until `service` answers its health check from its own process, echoing a
        `still starting` line every `STARTING_PROGRESS_S` meanwhile.

        Raises:
            RuntimeError: it exited, or says it can never become healthy.
            TimeoutError: not healthy within `timeout_s` seconds.
        """
        start = time.monotonic()
        port = port_of(service.url)
        progress_at = start + STARTING_PROGRESS_S
        while time.monotonic() - start < timeout_s:
            if time.monotonic() >= progress_at:
                progress_at += STARTING_PROGRESS_S
                self.echo(
                    f"{service.name:<9} still starting ({time.monotonic() - start:.0f} s of "
                    f"{timeout_s:g} s; log {service.log_path})"
                )
            assert service.proc is not None
            if service.proc.poll() is not None:
                tail = service.log_tail()
                self.stop()
                raise RuntimeError(
                    f"{service.name} exited with {service.proc.returncode} during start-up"
                    f"{f' ({service.fix})' if service.fix else ''}; log {service.log_path}:\n{tail}"
                )
            # A service that says it can never become healthy (and is this stack's own) fails
            # the start-up now, not after the whole timeout.
            reason = service.failed() if service.failed else None
            if reason and listens(service.proc.pid, port):
                tail = service.log_tail()
                error = _last_error_line(tail)
                self.stop()
                raise RuntimeError(
                    f"{service.name} cannot start: {reason}"
                    f"{f' ({error})' if error else ''}"
                    f"{f'; {service.fix}' if service.fix else ''}; "
                    f"the traceback is in {service.log_path}"
                )
            # Healthy only when the answer comes from this service's own process: another
            # process that holds the port (another stack's) is never taken for it.
            if service.health() and listens(service.proc.pid, port):
                self.echo(
                    f"{service.name:<9} {service.url}  healthy ({time.monotonic() - start:.1f}s)"
                )
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{service.name} not healthy after {timeout_s}s; see {service.log_path}")

    def _write_state(self) -> None:
        s = self.settings
        state = {
            "pid": os.getpid(),
            "instance": self.instance,
            "redis_url": s.redis_url(),
            **({"engine": s.engine.urls[0]} if s.engine.backend == "external" else {}),
            **{svc.name: svc.url for svc in self.services},
            "metrics_path": s.trainer.logging.metrics_path,
            "moved_ports": {
                name: {"configured": configured, "port": port}
                for name, (configured, port) in self.moved.items()
            },
        }
        # Atomically: a reader (or a crash mid-write) never sees a truncated file.
        path = self.state_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def revive_redis(self) -> int | None:
        """Start the stack's own Redis again if it exited (same port and data dir; with AOF on
        it comes back with every acknowledged write), so the services, which wait out Redis
        outages, go on. Returns the exit code it had, or None when it runs (or is external).

        Raises:
            RuntimeError, TimeoutError: it does not start again.
        """
        if self.redis is None or self.redis.proc is None or self.redis.proc.poll() is None:
            return None
        code = self.redis.proc.returncode
        self.redis.start()
        return code

    def _check_trainer_settings(self) -> None:
        """Refuse algorithm settings the trainer would refuse (unknown or dropped
        `trainer.algorithm.params`, parts whose inputs are missing) before any service starts.

        Raises:
            ConfigurationError: the trainer's check failed (its message).
        """
        problem = trainer_settings_problem(self.env)
        if problem is not None:
            raise ConfigurationError(problem)

    def exited(self) -> list[Service]:
        """The services whose process has exited (`Service.exit_report` says how, with the
        tail of its log)."""
        return [s for s in self.services if s.proc and s.proc.poll() is not None]

    def revive(self, name: str) -> int | None:
        """Start service `name` again if its process exited, with the same command, settings
        and log (the trainer resumes from its newest checkpoint and commit log, so a crashed
        trainer loses nothing and trains nothing twice; the other services keep running).
        Returns the exit code it had, or None when it runs (or is not in the stack)."""
        service = next((s for s in self.services if s.name == name), None)
        if service is None or service.proc is None or service.proc.poll() is None:
            return None
        code = service.proc.returncode
        index = self.services.index(service)
        self.services.remove(service)
        self._launch(service)
        self.services.insert(index, self.services.pop())  # its place in the stop order
        return code

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every child in reverse start order, then Redis. The trainer is stopped, and
        waited for, first: on its way out it finishes its checkpoint and its push in progress,
        which must find the engines still serving (stopped together, the push failed on
        engines already gone and was logged as errors). The others are then stopped together.
        """
        first = [s for s in self.services if s.name == "trainer"]
        rest = [s for s in self.services if s.name != "trainer"]
        for group in (first, rest):
            for service in reversed(group):
                if service.proc and service.proc.poll() is None:
                    service.proc.terminate()
            for service in reversed(group):
                if service.proc:
                    try:
                        service.proc.wait(timeout=grace_s)
                    except subprocess.TimeoutExpired:
                        service.proc.kill()
                        service.proc.wait()
        self.services.clear()
        if self.redis:
            self.redis.stop()
            self.redis = None
        for reservation in self.ports:
            reservation.release()
        self.ports.clear()
        if self._lock_fd is not None:  # the state file is this stack's only while it holds it
            (self.state_dir / STATE_FILE).unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _warn(message: str) -> None:
    print(f"flywheel: {message}", file=sys.stderr)


def stack_state(state_dir: str, warn: Callable[[str], None] = _warn) -> dict[str, str] | None:
    """The state file of the stack of `state_dir` (`flywheel up`'s, or a demo's own) when the
    process it names is alive, else None.

    A state file that cannot be read as a JSON object (truncated, edited) is no running stack:
    `warn` gets one line naming it.
    """
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
    except (OSError, ValueError) as exc:
        warn(
            f"ignoring the unreadable stack state file {path} ({exc}); taking it as no running "
            "stack. Delete it if no `flywheel up` runs from that state dir."
        )
        return None
    return state if process_alive(state.get("pid")) else None


def down_command(state_dir: str) -> str:
    """The command that stops the stack of `state_dir`: `flywheel down`, prefixed with
    `FLYWHEEL_STATE_DIR=...` unless `state_dir` is the default one (`.flywheel`).

    Example: "runs/demo/stack" -> "FLYWHEEL_STATE_DIR=runs/demo/stack flywheel down"."""
    import shlex  # noqa: PLC0415

    default = FlywheelSettings.model_fields["state_dir"].default
    if Path(state_dir).resolve() == Path(default).resolve():
        return "flywheel down"
    return f"FLYWHEEL_STATE_DIR={shlex.quote(state_dir)} flywheel down"


def running_stack(state_dir: str, warn: Callable[[str], None] = _warn) -> dict[str, str] | None:
    """URLs of a stack started by `flywheel up` that is still alive and serving, else None
    (`stack_state`, and the gateway answers /healthz)."""
    state = stack_state(state_dir, warn)
    if state is None or not http_ok(f"{state.get('gateway', '')}/healthz")():
        return None
    return state


def _last_error_line(log: str) -> str:
    """The last `SomeError: message` line of a log (a traceback's summary), else ""."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        head = line.split(":", 1)[0]
        if head.rsplit(".", 1)[-1].endswith(("Error", "Exception")) and " " not in head:
            return line[:300]
    return ""


def process_alive(pid: object) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, exited but not yet reaped by
    its parent, counts as exited; a stale state file names a dead process)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def trainer_settings_problem(
    env: Mapping[str, str], config_file: str | os.PathLike[str] | None = None
) -> str | None:
    """Why the trainer would refuse its algorithm settings (unknown or dropped
    `trainer.algorithm.params`, parts whose inputs are missing), or None: the trainer's own
    check, `python -m flywheel.trainer --check-settings`, run with `env` (and `--config
    config_file` when given), so torch is imported in that process only.

    Returns:
        The trainer's message without its program prefix, e.g. "invalid [trainer] settings:
        algorithm part 'ppo_clip' takes no parameters; ...", or None when it accepts them.
    """
    command = [sys.executable, "-m", "flywheel.trainer", "--check-settings"]
    if config_file is not None:
        command += ["--config", os.fspath(config_file)]
    done = subprocess.run(command, env=dict(env), capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    message = lines[-1] if lines else f"exit code {done.returncode}"
    return message.removeprefix("flywheel-trainer: ")
