"""The gateway's /dashboard on a real running stack (tiny model, three trainer steps).

- Headless Chromium (Debian `chromium`) loads the page: the reward and loss curves are drawn
  with one point per trainer step, the recent Samples are listed with their sampled tokens
  marked, and a screenshot is written (runs/dashboard.png, or $FLYWHEEL_DASHBOARD_PNG).
- The JSON endpoints return exactly what the trainer logged and the streams hold; advantages
  are the group-normalized rewards; the gateway's /metrics carries the stream gauges.
- With API keys in use, the page needs an admin key: a key form instead of the page, 403 for an
  agent key, and an HttpOnly cookie holding a login token after logging in with an admin key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from flywheel.core.auth import KeyStore
from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.streams import FIELD
from flywheel.gateway.dashboard import COOKIE, group_advantages

from .ops_stack import GROUP_SIZE, STEPS, ops_stack  # noqa: F401  (session fixture)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,1800",
    "--virtual-time-budget=5000",
]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: `make test` installs it (apt, make system-tools)")
        pytest.skip("chromium is not installed here (make system-tools)")
    return exe


def _browse(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{time.monotonic_ns()}"  # fresh --user-data-dir per run
    return subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dashboard_worked_example_of_advantages():
    # group a: rewards 1, 0 -> mean 0.5, std 0.5 -> +1, -1; group b: one member -> 0;
    # group c: 2, 2, 5 -> mean 3, std sqrt((1+1+4)/3) = sqrt(2) -> -0.7071, -0.7071, 1.4142;
    # no reward -> None.
    adv = group_advantages(
        ["a", "a", "b", "c", "c", "c", "d"], [1.0, 0.0, 0.3, 2.0, 2.0, 5.0, None]
    )
    assert adv[:3] == [1.0, -1.0, 0.0] and adv[6] is None
    assert adv[3:6] == pytest.approx([-0.70711, -0.70711, 1.41421], abs=1e-5)


def test_chromium_renders_the_curves_and_samples(ops_stack, tmp_path):  # noqa: F811
    url = f"{ops_stack.urls['gateway']}/dashboard"
    png = Path(os.environ.get("FLYWHEEL_DASHBOARD_PNG", ROOT / "runs" / "dashboard.png"))
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    shot = _browse(url, tmp_path, f"--screenshot={png}")
    assert png.is_file() and png.stat().st_size > 10_000, shot.stderr[-2000:]
    dom = _browse(url, tmp_path, "--dump-dom").stdout
    assert 'data-loaded="1"' in dom, dom[:3000]
    assert "update failed" not in dom
    for chart in ("chart-reward", "chart-loss"):
        tag = dom[dom.index(f'id="{chart}"') :][:200]
        assert f'data-points="{STEPS}"' in tag, tag
    assert 'data-series="reward/mean"' in dom
    assert f'data-count="{STEPS * GROUP_SIZE}"' in dom
    assert dom.count('data-mask="1"') >= STEPS * GROUP_SIZE  # sampled tokens are marked
    # The curves were drawn: the chart line color is in the screenshot, inside the chart row.
    from PIL import Image  # noqa: PLC0415

    image = Image.open(png).convert("RGB")
    assert image.size[0] >= 1200
    top = image.crop((0, 0, image.size[0], 400))
    blue = sum(1 for px in top.get_flattened_data() if px == (47, 111, 219))
    assert blue > 200, f"no curve pixels ({blue}) in {png}"


def test_api_returns_what_the_trainer_logged_and_the_streams_hold(ops_stack):  # noqa: F811
    gw = ops_stack.urls["gateway"]
    curves = httpx.get(f"{gw}/dashboard/api/curves").json()
    lines = [json.loads(x) for x in ops_stack.metrics_path.read_text().splitlines()]
    assert curves["steps"] == [x["step"] for x in lines] == list(range(1, STEPS + 1))
    assert curves["series"]["reward/mean"] == pytest.approx([x["reward/mean"] for x in lines])
    assert any(k.startswith("loss/") for k in curves["series"])
    assert httpx.get(f"{gw}/dashboard/api/curves", params={"since": 2}).json()["steps"] == [3]

    data = httpx.get(f"{gw}/dashboard/api/samples", params={"limit": 50}).json()
    assert data["source"] == ops_stack.settings.streams.key("train")
    client = connect(ops_stack.settings.redis_url())
    stored = {
        decode_sample(f[FIELD]).sample_id: decode_sample(f[FIELD])
        for _, f in client.xrange(data["source"])
    }
    assert len(data["samples"]) == len(stored) == STEPS * GROUP_SIZE
    by_group: dict[str, list[dict]] = {}
    for shown in data["samples"]:
        sample = stored[shown["sample_id"]]
        start = shown["omitted_before"]
        assert [m for _, m in shown["tokens"]] == list(sample.loss_mask)[
            start : start + len(shown["tokens"])
        ]
        assert shown["reward"] == pytest.approx(sample.reward)
        by_group.setdefault(shown["group_id"], []).append(shown)
    for members in by_group.values():  # rewards differ in each group -> advantages +1 / -1
        members.sort(key=lambda m: m["reward"])
        assert [m["advantage"] for m in members] == pytest.approx([-1.0, 1.0])

    streams = {s["name"]: s for s in httpx.get(f"{gw}/dashboard/api/streams").json()["streams"]}
    assert streams["train"]["length"] == STEPS * GROUP_SIZE
    metrics = httpx.get(f"{gw}/metrics").text
    assert 'flywheel_stream_lag_entries{group="trainer",stream="train"} 0.0' in metrics
    assert f'flywheel_stream_length_entries{{stream="rollouts"}} {STEPS * GROUP_SIZE}.0' in metrics


def test_with_api_keys_the_dashboard_needs_an_admin_key(ops_stack):  # noqa: F811
    gw = ops_stack.urls["gateway"]
    store = KeyStore(connect(ops_stack.settings.redis_url()), ops_stack.settings.streams.prefix)
    admin, admin_rec = store.create("admin", "ops-test-admin")
    agent, agent_rec = store.create("agent", "ops-test-agent")
    try:
        deadline = time.monotonic() + 30  # the gateway re-checks "any keys?" every few seconds
        while time.monotonic() < deadline:
            page = httpx.get(f"{gw}/dashboard")
            if page.status_code == 401:
                break
            time.sleep(0.5)
        assert page.status_code == 401 and 'action="/dashboard/login"' in page.text
        assert "Training curves" not in page.text
        api = httpx.get(f"{gw}/dashboard/api/curves")
        assert api.status_code == 401 and api.json()["error"]["code"] == "invalid_api_key"
        forbidden = httpx.get(
            f"{gw}/dashboard/api/curves", headers={"Authorization": f"Bearer {agent}"}
        )
        assert forbidden.status_code == 403
        # The cookie holds a login token: a key put there is no login.
        assert httpx.get(f"{gw}/dashboard/api/curves", cookies={COOKIE: admin}).status_code == 401

        login = httpx.post(f"{gw}/dashboard/login", data={"key": admin})
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
        with httpx.Client(base_url=gw, cookies=login.cookies) as browser:
            assert "Training curves" in browser.get("/dashboard").text
            assert browser.get("/dashboard/api/curves").json()["steps"][-1] == STEPS
            # The cookie is scoped to the dashboard: it is no key for the admin API.
            assert browser.get("/v1/admin/keys").status_code == 401
        assert (
            httpx.get(
                f"{gw}/dashboard/api/curves", headers={"Authorization": f"Bearer {admin}"}
            ).status_code
            == 200
        )
    finally:
        store.revoke(admin_rec.key_id)
        store.revoke(agent_rec.key_id)
        store.reopen()  # the shared stack serves other tests without keys


def test_samples_carry_votes_hints_masks_and_survive_a_poison_entry(
    redis_client, prefix, tiny_model_dir
):
    """Samples written to a real Redis stream as the reward service writes them; decoded with
    the real SmolLM2 tokenizer."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from flywheel._proto import sample_pb2  # noqa: PLC0415
    from flywheel.core.codec import encode_sample, new_sample  # noqa: PLC0415
    from flywheel.core.settings import StreamSettings  # noqa: PLC0415
    from flywheel.gateway.dashboard import DashboardData  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("What is 7 + 1?")
    reply = tok.encode(" The answer is 8.")
    ids = prompt + reply
    mask = [0] * len(prompt) + [1] * len(reply)
    streams = StreamSettings(prefix=prefix)
    for reward, votes in (
        (
            1.0,
            [sample_pb2.Vote(judge="prm@v2", has_value=True, value=1.0, explanation="correct sum")],
        ),
        (0.0, [sample_pb2.Vote(judge="prm@v2", has_value=False, explanation="no final verdict")]),
    ):
        sample = new_sample(
            group_id="g7",
            token_ids=ids,
            loss_mask=mask,
            rollout_logprobs=[-0.5 * m for m in mask],
            weight_versions=[4 if m else -1 for m in mask],
            prompt_length=len(prompt),
            reward=reward,
            has_reward=True,
            rewards={"verifier": reward},
            votes=votes,
            hint="add the units",
            finish_reason="stop",
        )
        redis_client.xadd(streams.key("train"), {FIELD: encode_sample(sample)})
    redis_client.xadd(streams.key("train"), {FIELD: b"\x00not a sample"})

    def decode(batch: list[int]) -> list[str]:
        return tok.batch_decode([[i] for i in batch])

    shown = DashboardData(redis_client, streams, None, decode).samples(10)["samples"]
    assert len(shown) == 2  # the poison entry is skipped, not fatal
    good, bad = sorted(shown, key=lambda s: -s["reward"])
    assert (good["advantage"], bad["advantage"]) == (1.0, -1.0)  # rewards 1, 0: mean .5, std .5
    assert good["votes"] == [{"judge": "prm@v2", "value": 1.0, "explanation": "correct sum"}]
    assert bad["votes"][0]["value"] is None  # an invalid vote is shown as invalid, not as 0
    assert good["hint"] == "add the units" and good["weight_version"] == 4
    assert "".join(p for p, _ in good["tokens"]) == tok.decode(ids)
    assert [m for _, m in good["tokens"]] == mask
