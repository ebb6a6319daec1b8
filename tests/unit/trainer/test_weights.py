"""Checkpoints (atomic, self-contained, tied weights once, keep K, resume) and the weight push."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from safetensors import safe_open

from flywheel.core.errors import ContractError, UpstreamError
from flywheel.trainer.export import export_hf
from flywheel.trainer.export import main as export_main
from flywheel.trainer.weights import (
    STATE_FILE,
    CheckpointStore,
    WeightPusher,
    WeightsStore,
    load_model,
    load_training_state,
    verify_checkpoint,
)

from .factories import tiny_model


@pytest.fixture
def source_dir(tmp_path):
    src = tmp_path / "initial"
    tiny_model(seed=1).save_pretrained(src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    return src


def test_save_is_self_contained_with_tied_head_stored_once(tmp_path, source_dir):
    model = load_model(source_dir)
    store = CheckpointStore(tmp_path / "ckpt", keep=2, source_dir=source_dir)
    path = store.save(model, 1, {"entry_ids": ["1-0"], "sample_ids": ["s1"]})
    assert path.name == "step_00000001"
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        STATE_FILE,
    } <= names
    assert not list((tmp_path / "ckpt").glob(".*"))  # no temporary folder left behind
    state = json.loads((path / STATE_FILE).read_text())
    assert state["step"] == 1 and state["weight_version"] == "1" and state["entry_ids"] == ["1-0"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys

    reloaded = load_model(path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def test_keeps_the_newest_k_and_resumes_from_the_newest_complete(tmp_path, source_dir):
    model = load_model(source_dir)
    store = CheckpointStore(tmp_path / "ckpt", keep=2, source_dir=source_dir)
    assert store.latest() is None
    for step in (1, 2, 3):
        store.save(model, step, {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step_00000002",
        "step_00000003",
    ]
    (tmp_path / "ckpt" / "step_00000009").mkdir()  # incomplete (no weights, no state): ignored
    (tmp_path / "ckpt" / ".step_00000010.tmp-1").mkdir()  # a crashed write
    latest = store.latest()
    assert latest.step == 3 and latest.state["weight_version"] == "3"


def test_verify_rejects_a_checkpoint_of_another_shape(tmp_path):
    small = tiny_model(hidden=32)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ContractError, match="F32"):
        verify_checkpoint(tmp_path / "small", tiny_model(hidden=64))


class FakeEngine:
    """httpx transport answering /update_weights_from_disk (fails the first `failures` calls)
    and /model_info (the version each engine serves: `served`, default "default" = 0)."""

    def __init__(self, failures: int = 0, served: dict[str, str] | None = None):
        self.failures = failures
        self.served = served or {}
        self.calls: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            version = self.served.get(request.url.host, "default")
            return httpx.Response(200, json={"weight_version": version})
        with self.lock:
            return self._update(request)

    def _update(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append({"url": str(request.url), **body})
        if len(self.calls) <= self.failures:
            return httpx.Response(400, json={"success": False, "message": "busy"})
        return httpx.Response(200, json={"success": True, "message": "ok"})


def pusher(
    engine: FakeEngine, urls=("http://e1", "http://e2"), attempts=3, pause="none"
) -> WeightPusher:
    client = httpx.Client(transport=httpx.MockTransport(engine))
    return WeightPusher(
        list(urls), timeout_s=5, attempts=attempts, client=client, backoff_s=0, pause=pause
    )


def test_push_reaches_every_engine_with_the_step_as_version(tmp_path):
    engine = FakeEngine()
    pusher(engine).push(tmp_path / "step_00000007", 7)
    assert sorted(c["url"] for c in engine.calls) == [
        "http://e1/update_weights_from_disk",
        "http://e2/update_weights_from_disk",
    ]
    (first,) = [c for c in engine.calls if "e1" in c["url"]]
    assert first | {"url": None} == {
        "url": None,
        "model_path": str((tmp_path / "step_00000007").resolve()),
        "weight_version": "7",
        "flush_cache": True,
        "abort_all_requests": False,
    }


def test_push_retries_then_succeeds(tmp_path):
    engine = FakeEngine(failures=2)
    pusher(engine, urls=["http://e1"], attempts=3).push(tmp_path, 1)
    assert len(engine.calls) == 3


def test_push_raises_after_bounded_retries(tmp_path):
    engine = FakeEngine(failures=100)
    with pytest.raises(UpstreamError, match="busy"):
        pusher(engine, urls=["http://e1"], attempts=3).push(tmp_path, 1)
    assert len(engine.calls) == 3


def test_push_reports_an_engine_that_fails_and_still_serves_the_others(tmp_path):
    class HalfBroken(FakeEngine):
        def _update(self, request):
            if "e2" in str(request.url):
                self.calls.append({"url": str(request.url)})
                return httpx.Response(503, json={"success": False, "message": "loading"})
            return super()._update(request)

    engine = HalfBroken()
    report = pusher(engine, attempts=2).push(tmp_path, 4)
    assert report.ok == ["http://e1"] and list(report.failed) == ["http://e2"]
    assert "loading" in report.failed["http://e2"]
    assert sum("e2" in c["url"] for c in engine.calls) == 2  # retried, then reported


def test_push_never_gives_an_engine_an_older_version(tmp_path):
    # e1 serves 9 (a resumed trainer training steps 7-9 again), e2 serves 6: only e2 is pushed
    engine = FakeEngine(served={"e1": "9", "e2": "6"})
    report = pusher(engine).push(tmp_path, 7)
    assert [c["url"] for c in engine.calls] == ["http://e2/update_weights_from_disk"]
    assert sorted(report.ok) == ["http://e1", "http://e2"] and report.skipped == ["http://e1"]
    engine.served["e1"] = "7"  # equal: already there, not pushed again
    assert pusher(engine).push(tmp_path, 7).skipped == ["http://e1"]


class PausingEngine(FakeEngine):
    """Also answers /pause_generation and /continue_generation (404 when `can_pause` is
    false); every path is recorded in order."""

    def __init__(self, can_pause=True, failures=0):
        super().__init__(failures=failures)
        self.can_pause = can_pause
        self.paths: list[str] = []
        self.pause_modes: list[str] = []

    def __call__(self, request):
        if request.url.path != "/model_info":
            self.paths.append(request.url.path)
        if request.url.path == "/pause_generation":
            self.pause_modes.append(json.loads(request.content)["mode"])
        if request.url.path in ("/pause_generation", "/continue_generation"):
            if not self.can_pause:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"status": "ok"})
        return super().__call__(request)


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_a_pausing_push_pauses_in_its_mode_updates_and_continues(tmp_path, mode):
    engine = PausingEngine()
    pusher(engine, urls=["http://e1"], pause=mode).push(tmp_path, 2)
    assert engine.paths == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert engine.pause_modes == [mode]


def test_a_paused_engine_is_continued_even_when_the_update_fails(tmp_path):
    engine = PausingEngine(failures=100)
    with pytest.raises(UpstreamError):
        pusher(engine, urls=["http://e1"], attempts=2, pause="in_place").push(tmp_path, 2)
    # every try pauses, fails, and continues: the engine is never left paused
    assert (
        engine.paths
        == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        * 2
    )


def test_an_engine_that_cannot_pause_gets_a_plain_update(tmp_path):
    engine = PausingEngine(can_pause=False)
    report = pusher(engine, urls=["http://e1"], pause="in_place").push(tmp_path, 2)
    assert report.ok == ["http://e1"]
    assert engine.paths == ["/pause_generation", "/update_weights_from_disk"]


def test_push_goes_to_every_engine_at_once(tmp_path):
    # each engine answers only after both calls arrived: a push one engine after the other
    # would time out on the first
    both = threading.Barrier(2, timeout=5)

    class Slow(FakeEngine):
        def __call__(self, request):
            if request.url.path == "/update_weights_from_disk":
                both.wait()
            return super().__call__(request)

    report = pusher(Slow(), attempts=1).push(tmp_path, 3)
    assert sorted(report.ok) == ["http://e1", "http://e2"] and not report.failed


def test_checkpoint_keeps_training_state_and_only_the_newest_optimizer(tmp_path, source_dir):
    model = load_model(source_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    store = CheckpointStore(tmp_path / "ckpt", keep=3, source_dir=source_dir)
    training = {"optimizer": optimizer.state_dict(), "rng": {"torch": torch.get_rng_state()}}
    first = store.save(model, 1, {}, training)
    second = store.save(model, 2, {}, training)
    assert not (first / "training" / "optimizer.pt").exists()  # pruned from older ones
    assert (first / "training" / "rng.pt").exists()
    restored = load_training_state(second, "optimizer")
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(restored)
    for key, state in optimizer.state_dict()["state"].items():
        assert torch.equal(fresh.state_dict()["state"][key]["exp_avg"], state["exp_avg"])
    assert load_training_state(second, "scheduler") is None


def test_export_writes_a_plain_servable_folder(tmp_path, source_dir):
    model = load_model(source_dir)
    store = CheckpointStore(tmp_path / "ckpt", keep=2, source_dir=source_dir)
    path = store.save(model, 5, {"entry_ids": ["1-0"]}, {"rng": {"x": 1}})
    out = export_hf(path, tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert STATE_FILE not in names and "training" not in names
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    served = load_model(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, served.state_dict()[name]), name
    with pytest.raises(FileExistsError):
        export_hf(path, out)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "export2")]) == 0
    assert (tmp_path / "export2" / "model.safetensors").is_file()
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "export3")]) == 2


def test_lora_checkpoint_holds_the_merged_weights(tmp_path, source_dir):
    # after a LoRA update, the saved plain model's logits equal the adapted model's logits

    from flywheel.core.trainer_settings import LoraSettings
    from flywheel.trainer.lora import add_lora

    settings = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = add_lora(load_model(source_dir), settings)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids).logits.square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    path = CheckpointStore(tmp_path / "ckpt", 2, source_dir).save(model, 1, {})
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "lora" in k or "base_layer" in k]  # noqa: SIM118
    with torch.no_grad():
        served = load_model(path)(input_ids=ids).logits
    torch.testing.assert_close(served, adapted, atol=1e-5, rtol=1e-5)
    initial = load_model(source_dir)(input_ids=ids).logits.detach()
    assert float((served - initial).abs().max()) > 1e-4  # the update is in the saved weights


def test_pushed_weights_of_a_lost_lineage_never_outrank_the_new_ones(tmp_path, source_dir):
    store = WeightsStore(tmp_path / "ckpt", source_dir, keep=2)
    state = {"w": torch.zeros(2)}
    for version in (6, 7):  # pushed by a run whose steps 1-7 no checkpoint covers
        store.write(version, state)
    # the version just written is kept although two higher leftovers outrank it by number
    assert store.write(1, state).is_dir()
    assert store.drop_after(0) == 2  # at the start of the trainer resumed at step 0
    store.write(2, state)
    store.write(3, state)
    assert sorted(p.name for p in store.root.iterdir()) == ["v_00000002", "v_00000003"]


def test_a_checkpoint_above_the_one_saved_never_outranks_it(tmp_path, source_dir):
    model = load_model(source_dir)
    store = CheckpointStore(tmp_path / "ckpt", keep=2, source_dir=source_dir)
    (store.path_for(9) / "training").mkdir(parents=True)  # left by a prune cut short
    saved = store.save(model, 1, {}, {"optimizer": {"state": {}}})
    assert (saved / "training" / "optimizer.pt").is_file()
    assert store.drop_after(1) == 1 and store.steps() == [1]
