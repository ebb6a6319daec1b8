"""`flywheel engines list|add|remove` against a real Redis and a real engine process: what the
command writes is what the shared fleet holds (and so what gateways and the trainer read)."""

from __future__ import annotations

import json

import pytest

from flywheel.core.fleet import Fleet
from flywheel.ops.cli import main


@pytest.fixture
def fleet_env(monkeypatch, redis_server, redis_client, prefix, tmp_path):
    monkeypatch.setenv("FLYWHEEL_REDIS__URL", redis_server.url)
    monkeypatch.setenv("FLYWHEEL_STREAMS__PREFIX", prefix)
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path / "state"))
    return Fleet(redis_client, prefix, [])


def test_add_list_remove(fleet_env, capsys, tiny_model_dir):
    from tests.engine_process import engine_process  # noqa: PLC0415

    with engine_process(tiny_model_dir, "--weight-version", "4") as url:
        assert main(["engines", "add", f"{url}/"]) == 0
        assert "gateways route to it once it serves weight version 0" in capsys.readouterr().out
        assert fleet_env.members() == {url: "admin"}
        assert main(["engines", "add", url]) == 0
        assert "already in the fleet" in capsys.readouterr().out
        fleet_env.add("http://127.0.0.1:9")  # nothing listens there
        fleet_env.set_version(4)
        assert main(["engines", "list", "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
        assert listing["weight_version"] == 4
        assert sorted(listing["engines"], key=lambda e: e["url"] != url) == [
            {"url": url, "source": "admin", "state": "in_service", "weight_version": 4},
            {
                "url": "http://127.0.0.1:9",
                "source": "admin",
                "state": "down",
                "weight_version": None,
            },
        ]
    assert main(["engines", "remove", url]) == 0
    assert fleet_env.urls() == ["http://127.0.0.1:9"]


def test_a_bad_url_or_a_missing_engine_is_one_line_saying_what_to_do(fleet_env):
    with pytest.raises(SystemExit, match="is not an engine URL: use http://host:port"):
        main(["engines", "add", "10.0.0.7:30000"])
    with pytest.raises(SystemExit, match="not in the fleet; `flywheel engines list` shows it"):
        main(["engines", "remove", "http://10.0.0.7:30000"])
    assert fleet_env.urls() == []


def test_the_last_engine_that_answers_is_removed_only_with_force(fleet_env, capsys, tiny_model_dir):
    """Removing the only engine that answers would leave every request a 502: refused, saying
    what to do, the fleet unchanged; `--force` removes it. An engine that does not answer is
    added in one spelling (no trailing slash) with a line saying it stays pending."""
    from tests.engine_process import engine_process  # noqa: PLC0415

    with engine_process(tiny_model_dir) as url:
        assert main(["engines", "add", "http://127.0.0.1:9/"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("added http://127.0.0.1:9, but it does not answer"), out
        assert "it stays pending" in out
        assert main(["engines", "add", f"{url}/"]) == 0
        assert capsys.readouterr().out.startswith(f"added {url}; gateways route to it")
        with pytest.raises(SystemExit, match="is the last engine that answers") as refused:
            main(["engines", "remove", f"{url}/"])
        assert "pass --force to remove it anyway" in str(refused.value)
        assert fleet_env.urls() == sorted([url, "http://127.0.0.1:9"])
        assert main(["engines", "list"]) == 0
        listing = capsys.readouterr().out
        assert f"{url}  admin   in_service  serves 0" in listing  # "default" is version 0
        assert "http://127.0.0.1:9  admin   down        serves no answer" in listing
        assert main(["engines", "remove", url, "--force"]) == 0
        assert fleet_env.urls() == ["http://127.0.0.1:9"]
    assert main(["engines", "remove", "http://127.0.0.1:9"]) == 0  # answers not: no loss
    assert fleet_env.urls() == []
