"""Code-test verifier: run the response's Python against the task's tests in a sandboxed child.

Each test runs in its own child process (`python -I`), so one hanging or crashing test fails only
itself. Limits per child: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), bytes written to
any file incl. stdout (RLIMIT_FSIZE: over it the child dies of SIGXFSZ), processes (RLIMIT_NPROC)
and a wall-clock timeout, after which the whole process group is killed. A timeout or any limit
hit is a failed test, never a hang. The cwd is a fresh temp dir, deleted afterwards.

Isolation modes (chosen once per process by probing, see `isolation_mode()`):
- "unshare": root with `unshare` and `chroot` available: the child runs in new network, PID,
  mount, IPC and UTS namespaces (`unshare -n -p -f -m -i -u --kill-child`), so it has only a down
  loopback and no route anywhere, sees only its own processes (a fresh /proc), and killing the
  namespace's first process kills every descendant. `_JAIL` then chroots it into a root holding
  only read-only binds of /usr (+ /lib, /bin links) and the interpreter's prefix, /dev/null,
  /dev/zero, /dev/urandom, and its temp dir as `/work`, and the harness drops to uid/gid 65534
  (nobody), so RLIMIT_NPROC applies and nothing outside /work is writable or even visible.
- "audit-hook" (fallback, not root or no `unshare`): a `sys.addaudithook` hook in the child,
  which Python code cannot remove, refuses socket creation/connection and spawning processes
  (subprocess, os.system, exec, fork). Best-effort: native extension code could bypass it.

A test passes only when the child prints a per-run random token after the code and the test ran,
so `sys.exit(0)`, `os._exit(0)` or printed "PASS" markers in the response cannot fake a pass.
Not proof against code that introspects the harness's own frames to read the token.

Task fields: `tests` (a list of Python snippets, usually `assert ...`, or one string); optional
`timeout_s` (wall seconds per test, default 5), `cpu_s` (default 2), `memory_mb` (default 512),
`max_output_bytes` (default 65536). Reward = fraction of tests passed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from flywheel.core.errors import InvalidRequestError

_CODE_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
NOBODY = 65534

# Runs as root in fresh namespaces: $1 = jail root, $2 = the test's dir, $3 = interpreter prefix,
# then the command. Mounts are private to the namespace and vanish with it.
_JAIL = r"""
set -e
J=$1; W=$2; P=$3; shift 3
mount --make-rprivate /
for d in /usr /lib /lib64 /bin /sbin "$P"; do
  if [ -L "$d" ]; then mkdir -p "$J$(dirname "$d")"; cp -P "$d" "$J$d"
  elif [ -d "$d" ]; then
    mkdir -p "$J$d"; mount --bind "$d" "$J$d"; mount -o remount,bind,ro,nosuid,nodev "$J$d"
  fi
done
mkdir -p "$J/work" "$J/proc" "$J/dev"
mount --bind "$W" "$J/work"
mount -t proc -o nosuid,nodev,noexec proc "$J/proc"
for f in null zero urandom; do touch "$J/dev/$f"; mount --bind "/dev/$f" "$J/dev/$f"; done
exec chroot "$J" "$@"
"""

_HARNESS = r"""
import json, os, sys
def _run():
    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    os.chdir(spec["cwd"])
    if spec["drop_uid"] and os.getuid() == 0:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    if spec["audit_hook"]:
        blocked = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
                   "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg",
                   "ctypes.dlopen", "ctypes.dlsym", "os.chroot", "os.setuid")
        paths = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                 "os.symlink", "os.link", "os.truncate", "os.utime", "os.listdir", "os.scandir",
                 "shutil.rmtree", "os.chdir")
        home = os.path.realpath(".") + os.sep
        stdlib = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix)})
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        def inside(path, roots):
            if isinstance(path, int) or path is None:
                return True
            return (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(roots)
        def hook(event, args):
            if event in blocked:
                raise PermissionError("sandbox: " + event + " is not allowed")
            if event == "open" and args:
                mode, flags = args[1] or "", args[2] or 0
                write = any(c in str(mode) for c in "wax+") or flags & writes
                if not inside(args[0], (home,) if write else (home, *stdlib)):
                    raise PermissionError("sandbox: files outside the work dir are off limits")
            elif event in paths and args and not inside(args[0], (home,)):
                raise PermissionError("sandbox: files outside the work dir are off limits")
        sys.addaudithook(hook)
    token = spec.pop("token")
    scope = {"__name__": "__main__"}
    exec(compile(spec["code"], "<response>", "exec"), scope)
    exec(compile(spec["test"], "<test>", "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\n" + token + "\n").encode())
_run()
"""


@dataclass(frozen=True)
class Limits:
    """Per-test limits: wall and CPU seconds, address space MiB, output bytes, processes."""

    timeout_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_processes: int = 64


@dataclass(frozen=True)
class TestResult:
    passed: bool
    reason: str
    """"ok", "timeout", "failed (exit N)", "killed by SIGNAME"."""
    output: str
    """Head of the child's stdout+stderr (at most 2000 chars), for debugging."""


@functools.cache
def isolation_mode() -> str:
    """ "unshare" when the namespaces and the chroot jail work here (root + util-linux + an
    interpreter inside its prefix), else "audit-hook"."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("unshare", "mount", "chroot"))):
        return "audit-hook"
    if not _interpreter().startswith(os.path.realpath(sys.base_prefix) + os.sep):
        return "audit-hook"
    with tempfile.TemporaryDirectory(prefix="flywheel-sandbox-") as tmp:
        argv = _jail_argv(tmp, [_interpreter(), "-I", "-c", "import os; os.chdir('/work')"])
        probe = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    return "unshare" if probe.returncode == 0 else "audit-hook"


def _interpreter() -> str:
    return os.path.realpath(sys.executable)


def _jail_argv(tmp: str, command: list[str]) -> list[str]:
    """`command` in new namespaces, chrooted into `<tmp>/jail` with `<tmp>/work` as /work."""
    jail, work = os.path.join(tmp, "jail"), os.path.join(tmp, "work")
    os.makedirs(jail, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    return [
        "unshare",
        "-n",
        "-p",
        "-f",
        "-m",
        "-i",
        "-u",
        "--kill-child",
        "--",
        "sh",
        "-c",
        _JAIL,
        "sh",
        jail,
        work,
        os.path.realpath(sys.base_prefix),
        *command,
    ]


def extract_code(response: str) -> str:
    """The last ```python fenced block of `response` (else the last ``` block, else all of it)."""
    blocks = _CODE_FENCE.findall(response)
    return blocks[-1] if blocks else response


def run_test(code: str, test: str, limits: Limits = Limits()) -> TestResult:
    """Run `code` then `test` in one sandboxed child; passed = both ran to the end."""
    mode = isolation_mode()
    token = secrets.token_hex(16)
    jailed = mode == "unshare"
    spec = {
        "code": code,
        "test": test,
        "token": token,
        "cwd": "/work" if jailed else ".",
        "drop_uid": jailed,
        "audit_hook": not jailed,
    }
    with tempfile.TemporaryDirectory(prefix="flywheel-sandbox-") as tmp:
        argv = [_interpreter() if jailed else sys.executable, "-I", "-c", _HARNESS]
        if jailed:
            argv = _jail_argv(tmp, argv)
            tmp = os.path.join(tmp, "work")
        os.chmod(tmp, 0o777)  # the child runs as nobody
        out_path = os.path.join(tmp, ".out")
        with open(out_path, "w+b") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                env={
                    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": "/work" if jailed else tmp,
                    "TMPDIR": "/work" if jailed else tmp,
                },
                start_new_session=True,
                preexec_fn=functools.partial(_set_limits, limits),
            )
            try:
                proc.communicate(json.dumps(spec).encode(), timeout=limits.timeout_s)
                reason = _exit_reason(proc.returncode)
            except subprocess.TimeoutExpired:
                reason = "timeout"
            finally:
                _kill_group(proc)
            out.seek(0)
            text = out.read(limits.max_output_bytes + 64).decode("utf-8", "replace")
    passed = reason == "ok" and text.rstrip("\n").endswith(token)
    if reason == "ok" and not passed:
        reason = "exited before the test finished"
    return TestResult(passed, reason, text.replace(token, "")[:2000])


def code_tests(response: str, task: dict[str, Any]) -> float:
    """Fraction of `task["tests"]` that pass against the response's code (see module doc)."""
    tests = task["tests"]
    tests = [tests] if isinstance(tests, str) else list(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise InvalidRequestError(
            "code_tests: 'tests' must be a non-empty list of strings", param="task"
        )
    limits = Limits(
        timeout_s=float(task.get("timeout_s", 5.0)),
        cpu_s=int(task.get("cpu_s", 2)),
        memory_mb=int(task.get("memory_mb", 512)),
        max_output_bytes=int(task.get("max_output_bytes", 65536)),
    )
    code = extract_code(response)
    return sum(run_test(code, t, limits).passed for t in tests) / len(tests)


def _set_limits(limits: Limits) -> None:
    """In the child before exec: rlimits are inherited by `unshare` and the harness."""
    cpu = max(1, int(limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_output_bytes, limits.max_output_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exit_reason(returncode: int) -> str:
    if returncode == 0:
        return "ok"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"failed (exit {returncode})"
