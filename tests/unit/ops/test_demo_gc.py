"""The demo driver frees each batch of episodes' reference cycles (an `OpenAI` client per
episode: its httpx client, SSL context and connection pool) as soon as the batch ends, not at
the cyclic collector's rare full passes, which let them pile up over a run."""

import gc
import weakref
from pathlib import Path

from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.demo.tasks import split


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _runner(tmp_path: Path) -> DemoRunner:
    return DemoRunner("http://127.0.0.1:9", "http://127.0.0.1:9", DemoConfig(), tmp_path)


def _without_automatic_gc(run):  # noqa: ANN001, ANN202
    gc.collect()
    gc.disable()  # only explicit collections: the test does not depend on allocation counts
    try:
        return run()
    finally:
        gc.enable()


def test_run_groups_frees_the_episodes_cycles(tmp_path):
    runner = _runner(tmp_path)
    refs: list[weakref.ref] = []

    def episode(problem, group_id):  # noqa: ANN001, ANN202
        obj = _Cycle()
        refs.append(weakref.ref(obj))
        return 1.0

    problems, _ = split()
    rewards = _without_automatic_gc(lambda: runner.run_groups(problems[:2], episode))
    assert rewards == [1.0] * 16
    assert len(refs) == 16 and all(r() is None for r in refs)
