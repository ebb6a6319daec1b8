"""A generation aborted by a weight push continues under the new weights, through real processes.

The embedded engine serves SmolLM2-135M-Instruct (version 0); a gateway process in front of it
records to a real Redis. The openai SDK streams a long chat turn of an episode session; while it
streams, a push aborts the row: `/update_weights_from_disk` with `abort_all_requests`, or the
trainer's own pusher with `trainer.push.pause = "abort"` (`/pause_generation` in abort mode, the
update, `/continue_generation`: SGLang's RL flow; the continuation waits while paused). The
gateway continues it from its tokens (prompt ids + the tokens so far) under version 1 and the
client's stream runs on. The recorded Sample then carries version 0
on the tokens before the abort and version 1 after, and each part passes the fidelity check
against its own weights (re-scored by the engine serving them) and fails it against the other's.
"""

from __future__ import annotations

import re

import httpx
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD
from flywheel.ops.fidelity import check_fidelity
from flywheel.ops.stack import Stack
from flywheel.trainer.weights import WeightPusher

from ..engine_process import engine_process

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "Tell me a long story about a lighthouse keeper and his dog, with many details."
TOL = 1e-3


def _continued(gateway: str) -> float:
    """The gateway's count of generations continued after an abort."""
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    m = re.search(r'flywheel_gateway_partial_rollouts_total\{outcome="continued"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def _push(engine: str, model_dir, version: str, abort: bool) -> None:
    r = httpx.post(
        f"{engine}/update_weights_from_disk",
        json={"model_path": str(model_dir), "weight_version": version, "abort_all_requests": abort},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["success"], r.text


@pytest.mark.parametrize("push", ["abort_all_requests", "pause_abort"])
def test_an_aborted_generation_continues_under_the_new_version(
    smollm2_dir, tmp_path, redis_server, push
):
    state = load_file(smollm2_dir / "model.safetensors")
    v1 = tmp_path / "v1"
    v1.mkdir()
    save_file(
        {**state, "model.norm.weight": state["model.norm.weight"] * 1.25}, v1 / "model.safetensors"
    )
    with engine_process(smollm2_dir, "--weight-version", "0", threads="2") as engine:
        settings = load_settings(
            redis={"url": redis_server.url},
            streams={"prefix": f"partial_{push}", "block_ms": 200},
            engine={"model_path": str(smollm2_dir)},
            gateway={
                "port": free_port(),
                "engine_urls": [engine],
                "default_max_tokens": 48,
                "request_timeout_s": 900,
            },
            state_dir=str(tmp_path / "state"),
        )
        with Stack(settings, echo=lambda _: None, only=("gateway",)) as running:
            gateway = running.services[0].url
            before = _continued(gateway)
            session = httpx.post(f"{gateway}/v1/sessions", json={"group_id": "partial"}).json()
            client = openai.OpenAI(base_url=session["base_url"], api_key="local", max_retries=0)
            stream = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=48,
                temperature=1.0,
                seed=11,
                stream=True,
            )
            deltas: list[str] = []
            finish = None
            for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.delta.content:
                    deltas.append(choice.delta.content)
                    if len(deltas) == 6 and push == "pause_abort":  # the trainer's push
                        WeightPusher([engine], timeout_s=300, attempts=1, pause="abort").push(v1, 1)
                    elif len(deltas) == 6:  # the row is decoding: push with abort
                        _push(engine, v1, "1", abort=True)
                finish = choice.finish_reason or finish
            assert len(deltas) > 6, "the reply ended before the push"
            assert _continued(gateway) == before + 1  # continued by the gateway, not swapped
            sid = session["session_id"]
            assert httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={}).status_code == 200
            client_redis = connect(redis_server.url)
            key = settings.streams.key("rollouts")
            (sample,) = [
                s
                for s in (decode_sample(f[FIELD]) for _, f in client_redis.xrange(key))
                if s.session_id == sid
            ]
        # the Sample: version 0 on the tokens before the abort, 1 after, in one reply
        sampled = [k for k, m in enumerate(sample.loss_mask) if m]
        versions = [sample.weight_versions[k] for k in sampled]
        k = versions.index(1)
        assert 0 < k < len(versions) and versions == [0] * k + [1] * (len(versions) - k)
        assert sampled == list(range(sampled[0], sampled[0] + len(sampled)))  # one reply
        # the client's stream ran on seamlessly: its text is the recorded tokens' text
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        ids = [sample.token_ids[j] for j in sampled]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert finish in ("stop", "length")
        assert sample.finish_reason == finish
        # each part is faithful to its own weights and not to the other's
        on_v1 = check_fidelity(sample, engine, versions={1})
        wrong_v0 = check_fidelity(sample, engine, versions={0})
        assert on_v1.ids_match and on_v1.sampled_tokens == len(versions) - k
        assert on_v1.ok(TOL), on_v1
        assert not wrong_v0.ok(TOL), wrong_v0
        _push(engine, smollm2_dir, "0", abort=False)
        on_v0 = check_fidelity(sample, engine, versions={0})
        wrong_v1 = check_fidelity(sample, engine, versions={1})
        assert on_v0.sampled_tokens == k and on_v0.ok(TOL), on_v0
        assert not wrong_v1.ok(TOL), wrong_v1
