"""Fleet pushes: the per-engine deadline (counted, logged, not fatal), pushes that follow the
shared fleet in a real Redis, the watcher that gives a member serving an older version the
newest weights, and one push per engine at a time."""

from __future__ import annotations

import threading

import httpx

from flywheel.core.fleet import Fleet
from flywheel.trainer.fleet_push import PUSH_TIMEOUTS, push_each
from flywheel.trainer.weights import SKIPPED, WeightPusher

from .test_weights import FakeEngine


def timeouts(url: str) -> float:
    return PUSH_TIMEOUTS.labels(url)._value.get()


def test_an_engine_past_the_deadline_is_reported_and_counted_while_the_others_stand():
    release = threading.Event()

    def push_one(url: str) -> str | None:
        if url == "http://stuck":
            release.wait(30)  # never answers within the deadline
        return None

    before = timeouts("http://stuck")
    results = push_each(["http://a", "http://stuck", "http://b"], push_one, deadline_s=0.3)
    release.set()
    assert results["http://a"][0] is None and results["http://b"][0] is None
    assert "fleet.push_deadline_s = 0.3 s" in results["http://stuck"][0]
    assert timeouts("http://stuck") == before + 1
    assert timeouts("http://a") == 0


def test_a_push_with_a_stuck_engine_is_not_fatal(tmp_path):
    release = threading.Event()

    class Stuck(FakeEngine):
        def __call__(self, request):
            if request.url.host == "e2" and request.url.path == "/update_weights_from_disk":
                release.wait(30)
            return super().__call__(request)

    client = httpx.Client(transport=httpx.MockTransport(Stuck()))
    pusher = WeightPusher(
        ["http://e1", "http://e2"], timeout_s=60, attempts=1, client=client, engine_deadline_s=0.5
    )
    report = pusher.push(tmp_path, 4)
    release.set()
    assert report.ok == ["http://e1"]
    assert list(report.failed) == ["http://e2"] and "deadline" in report.failed["http://e2"]


def test_pushes_follow_the_fleet_and_the_watcher_catches_up_a_joined_engine(
    tmp_path, redis_client, prefix
):
    engine = FakeEngine()
    client = httpx.Client(transport=httpx.MockTransport(engine))
    fleet = Fleet(redis_client, prefix, ["http://e1"])
    fleet.seed()
    fleet.set_version(40)  # an older run's label: the watcher starts from what is served
    pusher = WeightPusher([], timeout_s=5, attempts=1, client=client, fleet=fleet, refresh_s=3600)
    assert fleet.version() == 0  # e1 serves "default"
    assert pusher.watcher.check() == {}  # nothing pushed yet: nothing to catch up
    report = pusher.push(tmp_path / "v5", 5)
    assert report.ok == ["http://e1"] and fleet.version() == 5
    engine.served["e1"] = "5"

    fleet.add("http://e2")  # joins mid-run, serving its initial weights
    assert pusher.watcher.check() == {"http://e2": None}
    last = engine.calls[-1]
    assert last["url"] == "http://e2/update_weights_from_disk"
    assert last["weight_version"] == "5"
    assert last["model_path"] == str((tmp_path / "v5").resolve())
    engine.served["e2"] = "5"
    assert pusher.watcher.check() == {}  # caught up: nothing more

    fleet.remove("http://e1")
    assert pusher.push(tmp_path / "v6", 6).ok == ["http://e2"]
    pusher.close()


def test_one_push_per_engine_at_a_time_so_an_older_version_never_lands_after_a_newer(tmp_path):
    entered, release = threading.Event(), threading.Event()

    class Held(FakeEngine):
        def _update(self, request):
            response = super()._update(request)
            self.served[request.url.host] = self.calls[-1]["weight_version"]
            if self.calls[-1]["weight_version"] == "7":
                entered.set()
                release.wait(30)
            return response

    engine = Held()
    client = httpx.Client(transport=httpx.MockTransport(engine))
    pusher = WeightPusher(["http://e1"], timeout_s=30, attempts=1, client=client)
    newer = threading.Thread(target=pusher.push_with_retries, args=("http://e1", tmp_path, 7))
    newer.start()
    assert entered.wait(10)
    assert pusher.busy("http://e1")
    older: list[str | None] = []
    late = threading.Thread(
        target=lambda: older.append(pusher.push_with_retries("http://e1", tmp_path, 6))
    )
    late.start()  # waits for the running push, then finds 7 served
    release.set()
    newer.join(10)
    late.join(10)
    assert older == [SKIPPED]
    assert [c["weight_version"] for c in engine.calls] == ["7"]
