"""One process of the local stack (`Service`), the health checks `flywheel up` gates on, and which
process listens on a port (so a service counts healthy only when its own process answers)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Service:
    """A child process of the local stack: how to start it, how to tell it is healthy, its log."""

    name: str
    url: str
    module: str
    health: Callable[[], bool]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    args: list[str] = field(default_factory=list)
    """Command-line arguments after `python -m <module>`."""
    failed: Callable[[], str | None] | None = None
    """Why the service can never become healthy (it says so itself), else None."""
    fix: str = ""
    """What to change when `failed` gives a reason (e.g. which setting)."""
    log_offset: int = 0
    """Size of `log_path` before this run: older runs' lines end there."""
    command: list[str] = field(default_factory=list)
    """The whole command line, when it is not `python -m <module> <args>` (a launched SGLang)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for this service only, over the stack's."""

    def argv(self, python: str) -> list[str]:
        """The command that starts the service (`python` runs `-m <module>`)."""
        return self.command or [python, "-m", self.module, *self.args]

    def exit_report(self) -> str:
        """Why the stack lost this service: its exit code and the tail of its log (one message,
        for the CLI). Empty while it runs."""
        if self.proc is None or self.proc.returncode is None:
            return ""
        tail = self.log_tail().rstrip() or "(it wrote nothing)"
        return (
            f"{self.name} exited with {self.proc.returncode}; the end of its log "
            f"{self.log_path}:\n{tail}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        """The last lines (about `chars` characters) this run wrote to the service's log."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        if len(text) <= chars:
            return text
        tail = text[-chars:]
        return tail.split("\n", 1)[1] if "\n" in tail[:-1] else tail  # no cut-off first line


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except (httpx.HTTPError, httpx.InvalidURL):  # InvalidURL: e.g. from a hand-edited state
            return False

    return check


def auth_off_warning(gateway_url: str, auth: str) -> str | None:
    """One console line when the gateway at `gateway_url` serves clients without an API key
    (authentication off: `gateway.security.auth` = `auth`), naming how to turn it on; None when
    it refuses a request without a key (401), or cannot be asked.

    Asked as a client would: a request with no key for a session id that never exists is
    answered 404 by a gateway that serves it, 401 by one that requires keys.
    """
    try:
        reply = httpx.get(f"{gateway_url}/v1/sessions/auth-probe-0", timeout=5)
    except (httpx.HTTPError, httpx.InvalidURL):
        return None
    if reply.status_code == 401:
        return None
    how = (
        'set gateway.security.auth = "auto" or "on" and create a key: `flywheel keys create '
        "--role admin`"
        if auth == "off"
        else "create a key with `flywheel keys create --role admin` (keys are then required), "
        'or set gateway.security.auth = "on"'
    )
    return (
        f"WARNING: authentication is off: the gateway at {gateway_url} serves every client "
        f"without an API key, as admin (gateway.security.auth = {auth!r}). To turn it on, {how}."
    )


def engine_failed(url: str, what: str) -> Callable[[], str | None]:
    """`what` (e.g. "loading the model X failed") once the engine at `url` reports on /healthz
    (503, `{"status": "failed"}`) that loading its model failed: it stays up then, but never
    becomes healthy."""

    def check() -> str | None:
        try:
            resp = httpx.get(f"{url}/healthz", timeout=5)
            failed = resp.status_code == 503 and resp.json().get("status") == "failed"
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return what if failed else None

    return check


def instance_ok(url: str, instance: str) -> Callable[[], bool]:
    """200 from `url` with JSON `instance` equal to this stack's nonce (not another stack's)."""

    def check() -> bool:
        try:
            resp = httpx.get(url, timeout=5)
            return resp.status_code == 200 and resp.json().get("instance") == instance
        except (httpx.HTTPError, ValueError):
            return False

    return check


def grpc_ok(target: str) -> Callable[[], bool]:
    def check() -> bool:
        import grpc  # noqa: PLC0415
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    return check


def port_of(url: str) -> int:
    """The TCP port of `url` (`http://host:port/...` or `host:port`)."""
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP `port` (IPv4 and IPv6); None without /proc/net."""
    found: set[str] | None = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = found or set()
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                found.add(parts[9])
    return found


def _family(pid: int) -> set[int]:
    """`pid` and all its descendants (from /proc/<pid>/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    family, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in family:
            family.add(p)
            todo += children.get(p, [])
    return family


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` (or a descendant) holds the socket listening on TCP `port`.

    True where /proc is missing (the check is then skipped: ports are still reserved).
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    targets = {f"socket:[{inode}]" for inode in inodes}
    for p in _family(pid):
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p}/fd/{fd}") in targets:
                    return True
            except OSError:
                continue
    return False
