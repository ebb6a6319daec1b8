"""`flywheel keys create|list|revoke` against a real Redis."""

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
    assert capsys.readouterr().out.split() == [record.key_id, "admin", "ops"]
    assert main(["keys", "revoke", record.key_id]) == 0
    assert KeyStore(redis_client, prefix).verify(secret) is None
