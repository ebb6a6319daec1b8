"""`flywheel keys create|list|mark|revoke` against a real Redis."""

from flywheel.core.auth import KeyStore
from flywheel.ops.cli import main


def test_create_list_revoke(redis_server, redis_client, prefix, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FLYWHEEL_REDIS__URL", redis_server.url)
    monkeypatch.setenv("FLYWHEEL_STREAMS__PREFIX", prefix)
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path))
    assert main(["keys", "create", "--role", "admin", "--name", "ops"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    record = KeyStore(redis_client, prefix).verify(secret)
    assert record is not None and record.role == "admin" and record.name == "ops"
    assert main(["keys", "list"]) == 0
    assert capsys.readouterr().out.split() == [record.key_id, "admin", "train", "ops"]
    assert main(["keys", "revoke", record.key_id]) == 0
    assert KeyStore(redis_client, prefix).verify(secret) is None


def test_not_for_training_create_and_mark(
    redis_server, redis_client, prefix, monkeypatch, capsys, tmp_path
):
    monkeypatch.setenv("FLYWHEEL_REDIS__URL", redis_server.url)
    monkeypatch.setenv("FLYWHEEL_STREAMS__PREFIX", prefix)
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path))
    store = KeyStore(redis_client, prefix)
    assert main(["keys", "create", "--name", "private", "--not-for-training"]) == 0
    out = capsys.readouterr().out
    assert "(not for training)" in out
    record = store.verify(out.strip().splitlines()[-1])
    assert record is not None and record.train is False
    assert main(["keys", "list"]) == 0
    assert capsys.readouterr().out.split() == [record.key_id, "agent", "no-train", "private"]
    assert main(["keys", "mark", record.key_id, "--train"]) == 0
    assert store.list()[0].train is True
    assert main(["keys", "mark", record.key_id, "--not-for-training"]) == 0
    assert "not for training" in capsys.readouterr().out
    assert store.list()[0].train is False
