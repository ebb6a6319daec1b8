"""The `pi` coding agent (npm, pinned in tools/pi) against the running stack in each of its three
API modes (`openai-completions`, `openai-responses`, `anthropic-messages`), in print mode, with
only its read and bash tools, in a scratch folder, through a gateway that requires an API key.

Two `pi -p` runs make one live session (header `X-Session-Id`): the first asks for the number in
notes.txt, the second continues pi's saved conversation (pi sends its whole history again, in
its own wire format). Every request pi sends passes through a tap that keeps the gateway's
answers: a protocol error (any 4xx/5xx, or an error on pi's stderr) fails the test even when pi
exits 0 (it does, for example, when a compaction request is refused). SmolLM2-135M may answer
badly, or call a tool or not; what must hold is that every turn was served, extended the recorded
history without a fork, and re-scores on the engine to the recorded ids and logprobs.

Measured on the first request of the openai-completions mode (read + bash tools, pi's default
system prompt): about 3.2 KB, about 920 prompt tokens; with all four tools the issue's 5.7 KB.
The test prints the size of every request it sees (`pytest -s`)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from flywheel.ops.fidelity import check_fidelity

from .http_tap import http_tap
from .pi_agent import API_MODES, ensure_pi, run_pi, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
ROUTES = {
    "openai-completions": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
    "anthropic-messages": "/v1/messages",
}


@pytest.fixture(scope="module")
def pi():
    return ensure_pi()


def _text(content_json: str) -> str:
    """The text of a recorded message's content (a string, or parts with `text`)."""
    content = json.loads(content_json) if content_json else ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("api", API_MODES)
def test_pi_print_mode_task_is_served_and_recorded_faithfully(api, pi, keyed_gateway, tmp_path):
    gw = keyed_gateway
    auth = {"Authorization": f"Bearer {gw.agent_key}"}
    route = ROUTES[api]
    probe = httpx.post(f"{gw.gateway}{route}", json={}, headers=auth, timeout=60)
    if probe.status_code == 404:
        pytest.skip(f"POST {route} is not served by the gateway yet (404)")
    sid = f"pi-{api}-{uuid.uuid4().hex[:8]}"
    work = tmp_path / "scratch"
    work.mkdir()
    (work / "notes.txt").write_text("The number in this file is 4217.\n")
    agent_dir = tmp_path / "pi-agent"
    with http_tap(gw.gateway) as tap:
        write_config(
            agent_dir, api=api, url=tap.url, api_key=gw.agent_key, session_id=sid, model=MODEL
        )
        first = run_pi(
            pi,
            agent_dir,
            work,
            "Read the file notes.txt and tell me the number in it.",
            model=MODEL,
            resume=False,
        )
        second = run_pi(
            pi, agent_dir, work, "Now run `cat notes.txt` with bash.", model=MODEL, resume=True
        )
    for size in (e.request_bytes for e in tap.exchanges):
        print(f"pi {api} request to {route}: {size} bytes")
    errors = [f"{e.method} {e.path} -> {e.status}: {e.error_body}" for e in tap.errors()]
    assert not errors, "\n".join(errors)
    for run in (first, second):
        assert run.returncode == 0, run.stderr
        assert "error" not in run.stderr.lower(), run.stderr
    assert [(e.method, e.path) for e in tap.exchanges] == [("POST", route)] * len(tap.exchanges)
    assert len(tap.exchanges) >= 2  # one request per turn; the second run adds at least one
    # The second run resent the first run's conversation: its first request is a longer one.
    assert max(e.request_bytes for e in tap.exchanges[1:]) > tap.exchanges[0].request_bytes

    info = httpx.get(f"{gw.gateway}/v1/sessions/{sid}", headers=auth, timeout=60).json()
    assert info["mode"] == "live" and info["turns"] == len(tap.exchanges), info
    assert info["forks"] == 0, info["fork_reasons"]  # pi's history extended the recorded one
    finished = httpx.post(
        f"{gw.gateway}/v1/sessions/{sid}/finish", json={}, headers=auth, timeout=60
    )
    assert finished.status_code == 200, finished.text
    samples = gw.session_samples(sid)
    assert [s.turn_index for s in samples] == list(range(len(tap.exchanges)))
    for earlier, later in zip(samples, samples[1:], strict=False):
        # Each turn's context holds the previous turn's ids exactly as sampled.
        assert list(later.token_ids[: len(earlier.token_ids)]) == list(earlier.token_ids)
    # What pi printed at the end is the last recorded reply.
    assert second.stdout.strip() == _text(samples[-1].messages[-1].content_json).strip()
    for sample in samples:
        report = check_fidelity(sample, gw.engine, timeout_s=600)
        assert report.ids_match and report.ok(1e-3), (sample.turn_index, report)
