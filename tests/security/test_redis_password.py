"""Redis off loopback needs a password; loopback (local mode) does not."""

import pytest
from pydantic import ValidationError

from flywheel.core.settings import is_loopback, load_settings


@pytest.mark.parametrize(
    "url",
    [
        "",
        "redis://127.0.0.1:6379/0",
        "redis://localhost:6379/0",
        "redis://[::1]:6379/0",
        "unix:///run/redis.sock",
        "redis://:s3cret@redis:6379/0",
        "rediss://user:s3cret@redis.example.com:6380/0",
    ],
)
def test_accepted(url):
    assert load_settings(redis={"url": url}).redis.url == url


@pytest.mark.parametrize(
    "url",
    [
        "redis://redis:6379/0",
        "redis://10.0.0.5:6379/0",
        "rediss://redis.example.com:6380/0",
        "redis://user@redis:6379/0",
    ],
)
def test_refused_without_password(url):
    with pytest.raises(ValidationError, match="must carry a password"):
        load_settings(redis={"url": url})


def test_environment_override_is_checked_too(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_REDIS__URL", "redis://redis:6379/0")
    with pytest.raises(ValidationError):
        load_settings()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("10.1.1.1", False),
        ("gateway", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback
