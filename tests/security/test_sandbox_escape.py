"""The reward code sandbox against code that tries to get out (flywheel.reward.sandbox).

Each test runs hostile code as a model response and checks the effect outside the sandbox: no
file outside its temp dir read, written or deleted; no connection to a host socket; no signal,
/proc read or ptrace of another process; fork bombs, daemons, memory and output bombs contained
and nothing left running afterwards.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import pytest

from flywheel.reward import sandbox
from flywheel.reward.sandbox import Limits, run_test

FAST = Limits(timeout_s=4.0, cpu_s=2, memory_mb=256, max_output_bytes=4096)


@pytest.fixture(autouse=True, params=["unshare", "audit-hook"])
def mode(request, monkeypatch):
    """Every escape is tried in both isolation modes (the namespaces+chroot jail needs root)."""
    if request.param == "unshare" and sandbox.isolation_mode() != "unshare":
        pytest.skip("namespaces and chroot are not available here (not root?)")
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: request.param)
    return request.param


@pytest.fixture
def outside():
    """A world-readable, world-writable dir outside any sandbox, with a secret file in it."""
    path = Path("/tmp") / f"flywheel-canary-{secrets.token_hex(6)}"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    secret = secrets.token_hex(16)
    (path / "secret.txt").write_text(secret)
    (path / "secret.txt").chmod(0o666)
    yield path, secret
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _leftovers() -> list[int]:
    """Processes whose cwd is a deleted sandbox temp dir (i.e. outlived their sandbox)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if "flywheel-sandbox-" in cwd and cwd.endswith("(deleted)"):
            found.append(int(pid))
    return found


def test_cannot_read_files_outside_its_dir(outside):
    path, secret = outside
    code = f"print(open({str(path / 'secret.txt')!r}).read())\n"
    result = run_test(code, "pass", FAST)
    assert secret not in result.output and not result.passed


@pytest.mark.parametrize(
    "target", ["/etc/passwd", "/proc/1/environ", "/proc/self/environ", os.path.abspath(__file__)]
)
def test_cannot_read_host_files(target):
    code = f"data = open({target!r}, 'rb').read(64)\nprint('READ', len(data))\n"
    result = run_test(code, "pass", FAST)
    assert "READ" not in result.output and not result.passed


def test_cannot_write_or_delete_outside_its_dir(outside):
    path, secret = outside
    code = (
        f"import os\n"
        f"try:\n    open({str(path / 'planted.txt')!r}, 'w').write('x')\nexcept OSError: pass\n"
        f"try:\n    os.remove({str(path / 'secret.txt')!r})\nexcept OSError: pass\n"
    )
    run_test(code, "pass", FAST)
    assert not (path / "planted.txt").exists()
    assert (path / "secret.txt").read_text() == secret


def test_cannot_list_the_host_filesystem(outside):
    path, _ = outside
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import os\nprint('LIST', os.listdir({str(path)!r}))\n"
        f"print('HERE', os.listdir({here!r}))\n"
    )
    result = run_test(code, "pass", FAST)
    assert "LIST" not in result.output and "secret.txt" not in result.output
    assert "test_sandbox_escape.py" not in result.output


def test_cannot_reach_a_host_socket():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'ESCAPED')\n"
    )
    try:
        result = run_test(code, "pass", FAST)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert not result.passed


def test_cannot_resolve_names():
    result = run_test("import socket\nsocket.getaddrinfo('pypi.org', 443)\n", "pass", FAST)
    assert not result.passed


@pytest.fixture
def victim():
    """A host process holding a secret in its environment."""
    secret = secrets.token_hex(16)
    proc = subprocess.Popen(["sleep", "60"], env={"VICTIM_SECRET": secret})
    yield proc, secret
    proc.kill()
    proc.wait()


def test_cannot_signal_read_or_trace_other_processes(victim):
    proc, secret = victim
    pid = proc.pid
    code = (
        "import ctypes, os, signal\n"
        f"for p in ({pid}, {os.getpid()}, 1):\n"
        "    try:\n        os.kill(p, signal.SIGKILL)\n    except OSError: pass\n"
        f"try:\n    print(open('/proc/{pid}/environ').read())\nexcept OSError: pass\n"
        "try:\n    libc = ctypes.CDLL(None)\n"
        f"    print('PTRACE', libc.ptrace(16, {pid}, 0, 0))\nexcept Exception: pass\n"
    )
    result = run_test(code, "pass", FAST)
    time.sleep(0.2)
    assert proc.poll() is None, "the sandbox killed a host process"
    assert secret not in result.output
    assert "PTRACE 0" not in result.output
    status = Path(f"/proc/{pid}/status").read_text()
    assert "TracerPid:\t0" in status


def test_fork_bomb_is_contained_and_leaves_nothing_running():
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    t0 = time.monotonic()
    result = run_test(code, "pass", Limits(timeout_s=3.0, cpu_s=2, memory_mb=256))
    assert not result.passed and time.monotonic() - t0 < 15
    time.sleep(0.5)
    assert _leftovers() == []


def test_daemon_does_not_outlive_the_test():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(30)\n    os._exit(0)\n"
    )
    run_test(code, "pass", FAST)
    time.sleep(0.5)
    assert _leftovers() == []


def test_ignoring_sigterm_does_not_survive_the_timeout():
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    t0 = time.monotonic()
    result = run_test(code, "pass", Limits(timeout_s=1.0))
    assert result.reason == "timeout" and time.monotonic() - t0 < 5
    assert _leftovers() == []


def test_gradual_memory_bomb_fails():
    code = "x = []\nwhile True:\n    x.append(' ' * 10**6)\n"
    result = run_test(code, "pass", FAST)
    assert not result.passed and result.reason != "timeout"


def test_output_flood_to_files_is_bounded():
    code = "open('big', 'wb').write(b'x' * 50_000_000)\n"
    result = run_test(code, "pass", FAST)
    assert not result.passed
