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
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["KEY_ID", "ROLE", "TRAIN", "NAME"]
    assert row.split() == [record.key_id, "admin", "train", "ops"]
    for column in ("ROLE", "TRAIN", "NAME"):  # each value starts under its header
        assert row[header.index(column) - 2 : header.index(column)] == "  ", (header, row)
        assert row[header.index(column)] != " ", (header, row)
    assert main(["keys", "create", "--name", "ci"]) == 0
    agent = KeyStore(redis_client, prefix).verify(capsys.readouterr().out.split()[-1])
    assert main(["keys", "revoke", record.key_id]) == 0
    assert capsys.readouterr().out.strip() == f"revoked {record.key_id}"  # one key is left
    assert KeyStore(redis_client, prefix).verify(secret) is None
    assert main(["keys", "revoke", agent.key_id]) == 0
    out = capsys.readouterr().out
    assert "no agent or admin keys are left" in out and "refuses every request" in out
    assert "flywheel keys create --role admin" in out and "flywheel keys reopen" in out
    store = KeyStore(redis_client, prefix)
    assert store.any_keys()  # still closed
    assert main(["keys", "reopen"]) == 0
    assert not store.any_keys()
    capsys.readouterr()
    assert main(["keys", "list"]) == 0
    assert capsys.readouterr().out == "no API keys\n"  # no header over no rows
    store.create("agent")
    assert store.any_keys()
    try:  # refused while a key exists: a CLI message, not a traceback
        main(["keys", "reopen"])
    except SystemExit as exc:
        assert "still exist" in str(exc.code)
    else:
        raise AssertionError("reopen with a key left must fail")


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
    assert capsys.readouterr().out.split() == [
        *("KEY_ID", "ROLE", "TRAIN", "NAME"),
        *(record.key_id, "agent", "no-train", "private"),
    ]
    assert main(["keys", "mark", record.key_id, "--train"]) == 0
    assert store.list()[0].train is True
    assert main(["keys", "mark", record.key_id, "--not-for-training"]) == 0
    assert "not for training" in capsys.readouterr().out
    assert store.list()[0].train is False
