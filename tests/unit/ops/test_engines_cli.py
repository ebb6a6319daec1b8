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
            {"url": url, "source": "admin", "weight_version": 4},
            {"url": "http://127.0.0.1:9", "source": "admin", "weight_version": None},
        ]
    assert main(["engines", "remove", url]) == 0
    assert fleet_env.urls() == ["http://127.0.0.1:9"]


def test_a_bad_url_or_a_missing_engine_is_one_line_saying_what_to_do(fleet_env):
    with pytest.raises(SystemExit, match="is not an engine URL: use http://host:port"):
        main(["engines", "add", "10.0.0.7:30000"])
    with pytest.raises(SystemExit, match="not in the fleet; `flywheel engines list` shows it"):
        main(["engines", "remove", "http://10.0.0.7:30000"])
    assert fleet_env.urls() == []
