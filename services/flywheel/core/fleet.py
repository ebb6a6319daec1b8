"""The engine fleet: the engine URLs that every gateway and the trainer share, kept in Redis.

The fleet is a Redis hash `{prefix}:fleet:engines` (engine base URL -> the source that added
it) and the fleet's current weight version `{prefix}:fleet:version` (the newest version a
trainer push reached; docs/fleet.md). Sources, all written to the same hash:

- `static`: the configured list (`gateway.engine_urls`, else `engine.urls`, else the local
  engine; `static_urls`), written by each service at start (`Fleet.seed`);
- `dns`: Kubernetes discovery, the A/AAAA records of a headless Service
  (`fleet.discovery = "dns"`, `fleet.dns_name`), resolved with `socket.getaddrinfo` at every
  refresh; a headless Service publishes only ready pods, so a pod appears once its readiness
  probe passes and disappears when it stops;
- `admin`: added and removed by an operator (`POST/DELETE /v1/admin/engines` on any gateway,
  or `flywheel engines add|remove|list`).

An SGLang router is one engine URL like any other (it routes by itself); the trainer then
pushes to the workers behind it, listed in `trainer.push.engine_urls`, because the router does
not forward weight updates.

Torch-free and small: imported by the gateway, the trainer and the CLI.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import redis
from pydantic import Field, model_validator

from flywheel.core.redis_client import as_str
from flywheel.core.section import Section

if TYPE_CHECKING:
    from flywheel.core.settings import FlywheelSettings

log = logging.getLogger(__name__)

SOURCES = ("static", "dns", "admin")

_SYNC_LUA = """
-- KEYS[1] = fleet hash; ARGV[1] = source; ARGV[2..] = that source's URLs now.
-- Drops the source's URLs not listed, adds the listed ones not present (a URL another source
-- added keeps that source). Returns the number of fields changed.
local source = ARGV[1]
local keep = {}
for i = 2, #ARGV do keep[ARGV[i]] = true end
local changed = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i + 1] == source and not keep[all[i]] then
    redis.call('HDEL', KEYS[1], all[i])
    changed = changed + 1
  end
end
for i = 2, #ARGV do
  changed = changed + redis.call('HSETNX', KEYS[1], ARGV[i], source)
end
return changed
"""


class FleetSettings(Section):
    """`[fleet]`: where the engine list comes from (docs/fleet.md)."""

    discovery: Literal["static", "dns"] = "static"
    """static = the configured URLs plus engines added by an admin; dns = also every address
    of `dns_name` (a Kubernetes headless Service), resolved every `refresh_s`."""
    dns_name: str = ""
    """Host name whose A/AAAA records are the engines (e.g.
    `engine-headless.flywheel.svc.cluster.local`); needed when discovery = dns."""
    dns_port: int = Field(30000, ge=1, le=65535)
    """Port of every discovered engine."""
    dns_scheme: Literal["http", "https"] = "http"
    """Scheme of every discovered engine's URL."""
    refresh_s: float = Field(2.0, gt=0)
    """Seconds between two reads of the fleet (and DNS look-ups) by each gateway and the
    trainer: how long a joined or removed engine takes to be seen."""
    push_deadline_s: float = Field(900.0, ge=0)
    """Seconds one engine's weight push (every attempt) may take; past it the engine is
    counted (`flywheel_trainer_push_timeouts_total`), logged and behind, and the push goes on
    with the others; 0 = no deadline."""

    @model_validator(mode="after")
    def _dns_name_given(self) -> FleetSettings:
        if self.discovery == "dns" and not self.dns_name:
            raise ValueError(
                "fleet.discovery = 'dns' needs fleet.dns_name (the headless Service's name, "
                "e.g. engine-headless.flywheel.svc.cluster.local)"
            )
        return self


def normalize_url(url: str) -> str:
    """An engine base URL in one spelling: scheme://host:port without a trailing slash.

    Raises:
        ValueError: not an http(s) URL with a host, or it has a query or fragment.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an engine URL: use http://host:port")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: an engine URL has no query or fragment")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = f"{host}:{port}" if port else host
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def static_urls(settings: FlywheelSettings) -> list[str]:
    """The `static` source: `gateway.engine_urls`, else `engine.urls`, else the local engine's
    URL, which is left out when DNS discovery finds the engines (an empty list is then fine)."""
    if settings.fleet.discovery == "dns":
        return list(settings.gateway.engine_urls or settings.engine.urls)
    return settings.engine_urls()


Resolver = Callable[..., list[tuple[Any, ...]]]


def resolve_dns(
    name: str, port: int, scheme: str = "http", resolver: Resolver = socket.getaddrinfo
) -> list[str]:
    """The engine URLs of every address `name` resolves to, sorted.

    Raises:
        OSError (socket.gaierror): the name does not resolve (no ready pod, or DNS is down).
    """
    urls = set()
    for family, _, _, _, sockaddr in resolver(name, port, type=socket.SOCK_STREAM):
        host = sockaddr[0]
        host = f"[{host}]" if family == socket.AF_INET6 else host
        urls.add(f"{scheme}://{host}:{port}")
    return sorted(urls)


class Fleet:
    """The shared engine list and weight version in Redis.

    Args:
        client: a sync redis-py client.
        prefix: the deployment's key prefix (`streams.prefix`).
        static: the configured engine URLs (the `static` source).
        settings: `[fleet]`.
        resolver: `socket.getaddrinfo` or a stand-in with its signature (unit tests).
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        static: list[str],
        settings: FleetSettings | None = None,
        resolver: Resolver = socket.getaddrinfo,
    ):
        self.client = client
        self.key = f"{prefix}:fleet:engines"
        self.version_key = f"{prefix}:fleet:version"
        self.static = [normalize_url(u) for u in static]
        self.settings = settings or FleetSettings()
        self.resolver = resolver
        self._sync = client.register_script(_SYNC_LUA)
        self._dns_failed = False

    def seed(self) -> None:
        """Make the `static` source exactly the configured list (every service does this at
        start with the same settings)."""
        self.sync_source("static", self.static)

    def sync_source(self, source: str, urls: list[str]) -> int:
        """Make `source`'s engines exactly `urls` (atomic); returns the fields changed."""
        changed = int(self._sync(keys=[self.key], args=[source, *urls]))
        if changed:
            log.info("fleet source %s now lists %d engines: %s", source, len(urls), urls)
        return changed

    def add(self, url: str, source: str = "admin") -> bool:
        """Add `url` to the fleet; False when it is already a member.

        Raises:
            ValueError: `url` is not an engine URL.
        """
        url = normalize_url(url)
        added = bool(self.client.hsetnx(self.key, url, source))
        if added:
            log.info("engine %s joined the fleet (%s)", url, source)
        return added

    def remove(self, url: str) -> bool:
        """Remove `url` from the fleet; False when it was not a member. A `dns` member comes
        back at the next refresh while DNS lists it.

        Raises:
            ValueError: `url` is not an engine URL.
        """
        url = normalize_url(url)
        removed = bool(self.client.hdel(self.key, url))
        if removed:
            log.info("engine %s left the fleet", url)
        return removed

    def members(self) -> dict[str, str]:
        """Engine URL -> the source that added it."""
        raw = self.client.hgetall(self.key)
        return {as_str(k): as_str(v) for k, v in sorted(raw.items())}

    def urls(self) -> list[str]:
        """The fleet's engine URLs, sorted."""
        return sorted(self.members())

    def refresh(self) -> list[str]:
        """Resolve DNS when discovery = dns (a failed look-up changes nothing and is logged
        once), then the fleet's URLs."""
        s = self.settings
        if s.discovery == "dns":
            try:
                found = resolve_dns(s.dns_name, s.dns_port, s.dns_scheme, self.resolver)
            except OSError as exc:
                if not self._dns_failed:
                    log.warning(
                        "fleet: %s does not resolve (%s); the fleet keeps its engines",
                        s.dns_name,
                        exc,
                    )
                self._dns_failed = True
            else:
                self._dns_failed = False
                self.sync_source("dns", found)
        return self.urls()

    def version(self) -> int:
        """The fleet's current weight version (0 when no trainer has set one)."""
        raw = self.client.get(self.version_key)
        return int(raw) if raw is not None else 0

    def set_version(self, version: int) -> None:
        """Record `version` as the one an engine must serve before a gateway routes to it after
        it joined (set by the trainer after a push reached an engine, and at its start)."""
        self.client.set(self.version_key, int(version))
