"""Ctrl-C while episodes are in flight: once the interrupt is being handled they are cancelled
quietly (one line, "N in-flight episodes cancelled"), never logged one by one as the server's
failures while the demo stops its own stack; the interrupt message names the stack's folder, its
size and the command that deletes it. A real SIGINT over real HTTP (the stub gateway and engine
of test_demo_interrupt, its chat turns after the interrupt held until the stack stops, so the
episodes are mid-turn however late the main thread handles the signal); the fake stack's stop
shuts the stub down, as stopping the real stack takes the gateway away."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

import pytest

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.demo.agent import answer
from flywheel.ops.demo.cancel import EpisodeCancelled
from flywheel.ops.demo.tool_agent import run_episode

from .test_demo_interrupt import _Stub, stub  # noqa: F401 (the stub gateway fixture)


class _SlowStub(_Stub):
    """`_Stub` whose chat turns after the interrupt (those of step 2) are held until `released`
    is set (the stack's stop): the interrupt finds those episodes mid-turn, however long the
    main thread takes to handle it. A fixed delay would not do: a process starved of CPU may
    handle the signal after the episodes have ended, leaving nothing to cancel."""

    interrupt_at = 5  # step 2's first session (step 1 has 4)
    released = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        if self.path.endswith("/chat/completions"):
            with self.lock:
                interrupted = type(self).training_sessions >= self.interrupt_at
            if interrupted:
                self.released.wait(60)  # bounded: a demo that never stops fails, not hangs
        super().do_POST()


def test_ctrl_c_cancels_in_flight_episodes_quietly_and_names_the_stack_folder(
    monkeypatch, tmp_path, stub, capsys
):
    _SlowStub.training_sessions = 0
    _SlowStub.released.clear()
    before = set(threading.enumerate())  # other tests' threads are not this demo's episodes
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"

    class Service:
        def __init__(self, name: str):
            self.name, self.url = name, url

    class FakeStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            self.services = [Service("gateway"), Service("engine")]
            self.state_dir = settings.state_dir
            self.redis, self.moved = None, {}  # every configured port was free

        def start(self) -> None:
            (tmp_path / "demo" / "stack").mkdir(parents=True, exist_ok=True)
            (tmp_path / "demo" / "stack" / "dump.rdb").write_bytes(b"0" * 3_000_000)

        def stop(self) -> None:  # the gateway goes away, as the real stack's does
            server.shutdown()
            server.server_close()
            _SlowStub.released.set()  # the held chat turns end

    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    out = tmp_path / "demo"
    argv = ["demo", "--new-stack", "--out", str(out), "--steps", "5"]
    assert cli.main([*argv, "--problems-per-step", "1", "--group-size", "4"]) == 130
    for thread in set(threading.enumerate()) - before:  # the episodes' workers end
        if thread.name.startswith("demo-episode"):
            thread.join(30)
            assert not thread.is_alive(), "an in-flight episode did not end"
    printed = capsys.readouterr()
    both = printed.out + printed.err
    assert "failed on the server" not in both and "finishing it failed" not in both, both
    assert "scored 0" not in both and "no answer from the gateway" not in both, both
    cancelled = [line for line in both.splitlines() if "in-flight episodes cancelled" in line]
    assert len(cancelled) == 1 and cancelled[0].split()[0].isdigit(), both
    assert int(cancelled[0].split()[0]) >= 1
    stack = out / "stack"
    assert f"the demo's stack folder {stack} holds 3.0 MB" in printed.err, printed.err
    assert f"rm -rf {stack}" in printed.err


def test_once_stopping_both_agents_requests_end_without_a_retry(stub):
    """The addition agent's and the tool agent's next request raises `EpisodeCancelled` (not
    retried by the openai client, not taken by the agent loop as the gateway's error)."""
    stopping = threading.Event()
    stopping.set()
    base = f"{stub}/s/s1/v1"
    began = time.monotonic()
    with pytest.raises(EpisodeCancelled):
        answer(base, "2 + 3?", model="m", temperature=0.0, max_tokens=8, stopping=stopping)
    with pytest.raises(EpisodeCancelled):
        run_episode(base, "2 + 3?", model="m", temperature=0.0, max_tokens=8, stopping=stopping)
    assert time.monotonic() - began < 2  # no retries with backoff
    calm = threading.Event()  # not stopping: the same clients are served
    assert answer(base, "2 + 3?", model="m", temperature=0.0, max_tokens=8, stopping=calm) == "5"
