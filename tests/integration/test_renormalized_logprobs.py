"""A forced tool call served the way SGLang reports constrained logprobs, through real processes.

SGLang 0.5.23 applies a grammar's vocabulary mask to the logits before its log-softmax, so the
logprob it reports for a constrained token is log q(t), renormalised over the allowed tokens,
not the model's log p(t) (docs/token-path.md, "Constrained tokens"). The embedded engine serves
SmolLM2-135M-Instruct with `engine.grammar_logprobs = "renormalized"`, which reports them so
(and without the "unmasked" note of its default); a gateway process in front of it records to a
real Redis. A `tool_choice: "required"` turn and a free turn of the same question follow. The
recorded Sample of the forced turn marks every sampled token in `logprob_renormalized`, the
free one marks none; the fidelity check compares the free turn's logprobs and only the ids of
the marked tokens; and the trainer's loss, scoring the Sample with the same model, takes the
ratio of the marked tokens against its own logprob (exactly 1) where the recorded one would have
given ratios well below 1.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD
from flywheel.ops.fidelity import check_fidelity
from flywheel.ops.stack import Stack
from flywheel.trainer.batch import collate
from flywheel.trainer.logprobs import selected_token_logprobs
from flywheel.trainer.step import StepConfig, token_loss

from ..engine_process import engine_process

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOL = 1e-3


def test_sglang_style_constrained_logprobs_are_marked_and_anchored(
    smollm2_dir, tmp_path, redis_server
):
    with engine_process(
        smollm2_dir, threads="2", grammar_logprobs="renormalized", startup_s=600
    ) as engine:
        settings = load_settings(
            redis={"url": redis_server.url},
            streams={"prefix": "renormalized", "block_ms": 200},
            engine={"model_path": str(smollm2_dir)},
            gateway={"port": free_port(), "engine_urls": [engine], "default_max_tokens": 48},
            state_dir=str(tmp_path / "state"),
        )
        with Stack(settings, echo=lambda _: None, only=("gateway",)) as running:
            gateway = running.services[0].url
            session = httpx.post(f"{gateway}/v1/sessions", json={"group_id": "renorm"}).json()
            client = openai.OpenAI(base_url=session["base_url"], api_key="local", max_retries=0)
            forced = client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                seed=1,
            )
            assert forced.choices[0].message.tool_calls, forced
            client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=2)
            sid = session["session_id"]
            assert httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={}).status_code == 200
            key = settings.streams.key("rollouts")
            samples = [
                s
                for s in (decode_sample(f[FIELD]) for _, f in connect(redis_server.url).xrange(key))
                if s.session_id == sid
            ]
        assert len(samples) == 2, samples
        (marked,) = [s for s in samples if len(s.logprob_renormalized)]
        (free,) = [s for s in samples if not len(s.logprob_renormalized)]
        # every sampled token of the forced turn is marked, nothing else
        assert list(marked.logprob_renormalized) == list(marked.loss_mask)
        # fidelity: ids everywhere, logprobs of the free turn; the marked ones are not compared
        report = check_fidelity(marked, engine)
        assert report.ids_match and report.sampled_tokens == 0
        assert report.renormalized_tokens == sum(marked.loss_mask)
        free_report = check_fidelity(free, engine)
        assert free_report.ok(TOL) and free_report.sampled_tokens > 0, free_report

    # the trainer scores the marked Sample with the same weights (fp32, T = 1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    batch = collate([marked], torch.tensor([1.0]))
    lp = selected_token_logprobs(
        model, batch.input_ids_BT, batch.attention_mask_BT, batch.temperature_B, batch.loss_mask_BT
    )
    mask_BT = batch.loss_mask_BT
    recorded_BT, own_BT = batch.old_logprobs_BT, lp.logprobs_BT.detach()
    # log q >= log p on every marked token (a renormalisation only raises it), and the mask
    # carries real mass: against the recorded values the ratio falls well below 1
    assert bool((recorded_BT[mask_BT] >= own_BT[mask_BT] - TOL).all())
    assert float(torch.exp(own_BT - recorded_BT)[mask_BT].min()) < 0.5
    terms, stats = token_loss(lp, batch, StepConfig())
    # anchored: ratio 1 on every marked token, so the loss is -A = -1 there (PPO at r = 1)
    assert terms["pg"].detach()[mask_BT].tolist() == pytest.approx([-1.0] * int(mask_BT.sum()))
    assert float(stats["logprob/abs_diff/max"][mask_BT].max()) == 0.0
