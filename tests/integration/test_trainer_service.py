"""The trainer loop against a real Redis and a fake engine HTTP endpoint, with a tiny random model.

Covers: one step end to end (stream -> step -> checkpoint -> push -> ack -> metrics line), drops
(dead-lettered unscored samples), crash between checkpoint and ack (resume acks and re-pushes
instead of training twice), the stream-lease refresh, `python -m flywheel.trainer`, pushed
weights left from a lost run, and a resume whose pushes fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.core.codec import new_sample
from flywheel.core.errors import UpstreamError
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import StreamProducer
from flywheel.trainer.leases import LeaseKeeper
from flywheel.trainer.logprobs import naive_token_logprobs
from flywheel.trainer.service import build_trainer
from flywheel.trainer.sources import CONSUMER_GROUP

from .push_target import PushTarget

pytestmark = pytest.mark.integration
VOCAB = 256
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return path


class FakeEngine(PushTarget):
    """Records every push call (path and body); `fail` makes it refuse with a 400. It has no
    `/model_info`."""

    serves_model_info = False

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.fail = False
        super().__init__()

    def on_push(self, path: str, body: dict) -> tuple[int, dict]:
        self.calls.append({"path": path, **body})
        ok = not self.fail
        return (200 if ok else 400), {"success": ok, "message": "ok" if ok else "refused"}


@pytest.fixture
def engine():
    fake = FakeEngine()
    yield fake
    fake.close()


def merged(base: dict, update: dict) -> dict:
    """`base` with `update` merged in, section by section (nested dicts merge, values replace)."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def with_trainer(settings, **update):
    """`settings` with trainer settings `update` (nested by section, e.g. `data={...}`)."""
    trainer = type(settings.trainer).model_validate(merged(settings.trainer.model_dump(), update))
    return settings.model_copy(update={"trainer": trainer})


def trainer_settings(tmp_path, redis_server, prefix, engine_url, **trainer):
    """Trainer settings for these tests: fp32 on every machine (`precision` auto would run the
    decoder under bf16 autocast on a CPU with AVX512-BF16 or AMX, and the tests compare
    logprobs and weights at fp32 tolerances). `trainer` overrides by section."""
    base = {
        "model_path": str(trainer.pop("model_dir")),
        "consumer_name": "trainer-a",
        "port": free_port(),
        "precision": "fp32",
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "logging": {"metrics_path": str(tmp_path / "metrics.jsonl")},
        "batch": {"group_size": 4, "groups_per_step": 1, "group_wait_s": 30},
        "optim": {"lr": 1e-2},
        "push": {"engine_urls": [engine_url], "attempts": 1},
    }
    return load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": prefix, "block_ms": 100},
        trainer=merged(base, trainer),
    )


def make_group(model_dir: Path, group_id: str, rewards=(1.0, 0.0, 0.0, 1.0), temperature=0.7):
    """Samples whose rollout logprobs are the initial model's own, at `temperature`."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(len(group_id))
    samples = []
    for reward in rewards:
        ids = torch.randint(1, VOCAB, (1, 11), generator=gen)
        with torch.no_grad():
            logprobs_T = naive_token_logprobs(
                model, ids, torch.ones_like(ids), torch.tensor([temperature])
            )[0].tolist()
        mask = [0] * 5 + [1] * 6
        sample = new_sample(
            token_ids=ids[0].tolist(),
            loss_mask=mask,
            prompt_length=5,
            rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs_T, mask, strict=True)],
            weight_versions=[0 if m else -1 for m in mask],
            group_id=group_id,
            reward=reward,
            has_reward=True,
        )
        sample.sampling.temperature = temperature
        samples.append(sample)
    return samples


def publish(settings, samples) -> list[str]:
    producer = StreamProducer(connect(settings.redis_url()), settings.streams.key("train"))
    return [producer.publish(s) for s in samples]


def pending_count(settings) -> int:
    client = connect(settings.redis_url())
    return int(client.xpending(settings.streams.key("train"), CONSUMER_GROUP)["pending"])


def run_steps(trainer, steps=1, timeout_s=60.0) -> int:
    stop = threading.Event()
    timer = threading.Timer(timeout_s, stop.set)
    timer.start()
    try:
        return trainer.run(stop, max_steps=steps)
    finally:
        timer.cancel()


def test_one_step_end_to_end(tmp_path, redis_server, prefix, engine, model_dir):
    settings = trainer_settings(tmp_path, redis_server, prefix, engine.url, model_dir=model_dir)
    trainer = build_trainer(settings)
    assert engine.calls == []  # nothing to re-push on a fresh start
    unscored = new_sample(
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        rollout_logprobs=[0, -1, -1],
        weight_versions=[-1, 0, 0],
        group_id="g1",
        error="judge timed out",
    )
    publish(settings, [unscored, *make_group(model_dir, "g1")])

    assert run_steps(trainer) == 1
    ckpt = tmp_path / "ckpt" / "step_00000001"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer_config.json").is_file()
    before = load_file(model_dir / "model.safetensors")
    after = load_file(ckpt / "model.safetensors")
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert engine.calls == [
        {
            "path": "/update_weights_from_disk",
            "model_path": str((tmp_path / "ckpt" / "weights" / "v_00000001").resolve()),
            "weight_version": "1",
            "flush_cache": True,
            "abort_all_requests": False,
        }
    ]
    assert pending_count(settings) == 0
    dead = connect(settings.redis_url()).xrange(settings.streams.key("dead"))
    assert len(dead) == 1 and b"no_reward: judge timed out" in dead[0][1][b"error"]

    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (line["step"], line["weight_version"], line["n_samples"]) == (1, "1", 4)
    assert line["reward/mean"] == pytest.approx(0.5) and line["dropped/no_reward"] == 1
    # same weights and temperature as the rollout: the ratio is 1 up to fp noise (BUG-07)
    assert line["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert line["logprob/abs_diff_mean"] < 1e-4
    status = trainer.parts.status.snapshot()
    assert status["step"] == 1 and status["samples_trained"] == 4
    trainer.close()


def test_crash_before_ack_resumes_without_training_twice(
    tmp_path, redis_server, prefix, engine, model_dir
):
    settings = trainer_settings(tmp_path, redis_server, prefix, engine.url, model_dir=model_dir)
    first = build_trainer(settings)
    publish(settings, make_group(model_dir, "g1"))
    engine.fail = True
    with pytest.raises(UpstreamError):
        run_steps(first)
    first.close()
    # the stop checkpointed the step, so its entries were acked although the push failed
    assert (tmp_path / "ckpt" / "step_00000001" / "trainer_state.json").is_file()
    assert pending_count(settings) == 0

    engine.fail = False
    engine.calls.clear()
    resumed = build_trainer(
        settings.model_copy(
            update={"trainer": settings.trainer.model_copy(update={"consumer_name": "trainer-b"})}
        )
    )
    assert resumed.version == 1
    assert [c["weight_version"] for c in engine.calls] == ["1"]  # the checkpoint, pushed again
    assert pending_count(settings) == 0
    assert resumed.parts.status.snapshot()["ready"]
    resumed.close()


def test_lease_keeper_resets_idle_time_without_counting_deliveries(redis_server, prefix):
    client = connect(redis_server.url)
    stream = f"{prefix}:leases"
    entry_id = client.xadd(stream, {b"sample": b"x"}).decode()
    client.xgroup_create(stream, "g", id="0")
    client.xreadgroup("g", "c1", {stream: ">"})
    time.sleep(0.3)
    leases = LeaseKeeper(client, stream, "g", "c1", interval_s=60)
    leases.hold([entry_id])
    assert leases.refresh() == 1
    (row,) = client.xpending_range(stream, "g", min="-", max="+", count=10)
    assert row["time_since_delivered"] < 200 and row["times_delivered"] == 1


@pytest.mark.slow
def test_cli_runs_one_step_and_serves_http(tmp_path, redis_server, prefix, engine, model_dir):
    port = free_port()
    config = tmp_path / "flywheel.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_server.url}"\n[streams]\nprefix = "{prefix}"\nblock_ms = 100\n'
        f'[trainer]\nmodel_path = "{model_dir}"\nport = {port}\nmax_steps = 1\n'
        f'[trainer.checkpoint]\ndir = "{tmp_path / "ckpt"}"\n'
        f'[trainer.logging]\nmetrics_path = "{tmp_path / "m.jsonl"}"\n'
        f"[trainer.batch]\ngroup_size = 4\ngroups_per_step = 1\n"
        f'[trainer.push]\nengine_urls = ["{engine.url}"]\n'
    )
    env = os.environ | {"PYTHONPATH": str(REPO / "services")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.trainer", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
        status = httpx.get(f"http://127.0.0.1:{port}/status").json()
        assert status["step"] == 0 and status["ready"]
        publish(load_settings(config), make_group(model_dir, "g-cli"))
        output, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, output.decode()
    assert b"resolved settings" in output
    assert [c["weight_version"] for c in engine.calls] == ["1"]
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 1


class FolderEngine(FakeEngine):
    """Refuses a push whose folder does not exist, as SGLang does."""

    def on_push(self, path: str, body: dict) -> tuple[int, dict]:
        if not Path(body["model_path"]).is_dir():
            message = f"{body['model_path']} is neither a folder nor a .safetensors file"
            return 400, {"success": False, "message": message}
        return super().on_push(path, body)


def test_pushed_weights_left_from_a_lost_run_do_not_outrank_new_ones(
    tmp_path, redis_server, prefix, model_dir
):
    engine = FolderEngine()
    settings = trainer_settings(tmp_path, redis_server, prefix, engine.url, model_dir=model_dir)
    for version in (6, 7):  # pushed by a run stopped without a checkpoint covering them
        (tmp_path / "ckpt" / "weights" / f"v_0000000{version}").mkdir(parents=True)
    trainer = build_trainer(settings)
    assert not list((tmp_path / "ckpt" / "weights").glob("v_*"))  # deleted at the start
    publish(settings, make_group(model_dir, "g1"))
    assert run_steps(trainer) == 1  # the push of version 1 found its folder
    assert [c["weight_version"] for c in engine.calls] == ["1"]
    trainer.close()
    engine.close()


def test_a_resume_that_fails_leaves_no_push_thread_running(
    tmp_path, redis_server, prefix, engine, model_dir
):
    settings = trainer_settings(
        tmp_path, redis_server, prefix, engine.url, model_dir=model_dir, checkpoint={"every": 100}
    )
    first = build_trainer(settings)
    publish(settings, make_group(model_dir, "g1") + make_group(model_dir, "g2"))
    first.finish = lambda checkpoint=True: None  # killed: no checkpoint at the stop
    assert run_steps(first, steps=2) == 2
    first.close()
    engine.fail = True  # the recorded steps are trained again; their pushes fail
    before = set(threading.enumerate())
    with pytest.raises(UpstreamError):
        build_trainer(with_trainer(settings, consumer_name="trainer-b"))
    # a background thread left running in torch code aborts the interpreter at exit
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not [name for name in left if name == "push" or name.startswith("checkpoint")]


def test_sigterm_during_a_step_abandons_it_and_checkpoints_the_last_committed_step(
    tmp_path, redis_server, prefix, engine, model_dir
):
    settings = trainer_settings(
        tmp_path, redis_server, prefix, engine.url, model_dir=model_dir, checkpoint={"every": 100}
    )
    stop = threading.Event()
    trainer = build_trainer(settings)
    g1, g2 = make_group(model_dir, "g1"), make_group(model_dir, "g2")
    publish(settings, g1 + g2)

    def sigterm_in_step_2(*_) -> None:  # the second step's forward pass has begun
        if trainer.version == 1 and not stop.is_set():
            signal.raise_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # as main() sets it
    hook = trainer.parts.model.model.layers[0].register_forward_pre_hook(sigterm_in_step_2)
    timer = threading.Timer(120, stop.set)  # a bound only: the test ends by SIGTERM
    timer.start()
    try:
        assert trainer.run(stop) == 1
    finally:
        timer.cancel()
        hook.remove()
        signal.signal(signal.SIGTERM, previous)
    trainer.close()
    assert trainer.version == 1
    ckpt = tmp_path / "ckpt"
    state = json.loads((ckpt / "step_00000001" / "trainer_state.json").read_text())
    assert len(state["entry_ids"]) == 4 and not (ckpt / "step_00000002").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1]  # step 2 was never committed
    assert pending_count(settings) == 4  # g2's entries: not acked, read again after a restart

    resumed = build_trainer(settings)  # the same consumer name takes back its pending entries
    assert resumed.version == 1
    assert run_steps(resumed) == 1 and resumed.version == 2
    assert pending_count(settings) == 0
    resumed.close()
