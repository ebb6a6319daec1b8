"""The shared engine fleet in a real Redis: sources, admin add/remove, DNS discovery (a stand-in
resolver with getaddrinfo's signature), the weight version, and the settings check."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from flywheel.core.fleet import Fleet, FleetSettings, normalize_url, resolve_dns
from flywheel.core.settings import load_settings


class Resolver:
    """getaddrinfo's answers for one name, changed by the test; `fail` raises gaierror."""

    def __init__(self, *addrs: str):
        self.addrs = list(addrs)
        self.fail = False

    def __call__(self, host, port, type=0):  # noqa: A002 (getaddrinfo's keyword)
        if self.fail:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for addr in self.addrs:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sockaddr = (addr, port, 0, 0) if family == socket.AF_INET6 else (addr, port)
            out.append((family, type, 6, "", sockaddr))
            out.append((family, type, 6, "", sockaddr))  # getaddrinfo repeats per protocol
        return out


def test_normalize_url_spells_one_engine_one_way_and_refuses_what_is_not_one():
    assert normalize_url("http://Engine-0:30000/") == "http://engine-0:30000"
    assert normalize_url(" http://[fd00::1]:30000 ") == "http://[fd00::1]:30000"
    for bad in ("engine:30000", "ftp://e:1", "http://:30000", "http://e:1?x=1", "http://e:99999"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_sources_share_one_hash_and_admin_changes_are_seen_by_every_reader(redis_client, prefix):
    gateway = Fleet(redis_client, prefix, ["http://a:30000"])
    trainer = Fleet(redis_client, prefix, ["http://a:30000/"])
    gateway.seed()
    trainer.seed()  # the same list: nothing changes
    assert trainer.members() == {"http://a:30000": "static"}
    assert gateway.add("http://b:30000") is True
    assert gateway.add("http://b:30000/") is False  # already a member
    assert trainer.urls() == ["http://a:30000", "http://b:30000"]
    assert trainer.remove("http://a:30000") is True
    assert trainer.remove("http://a:30000") is False
    assert gateway.members() == {"http://b:30000": "admin"}


def test_dns_discovery_follows_the_records_and_keeps_the_engines_when_dns_fails(
    redis_client, prefix
):
    resolver = Resolver("10.1.0.5", "10.1.0.4")
    settings = FleetSettings(discovery="dns", dns_name="engine-headless", dns_port=30000)
    fleet = Fleet(redis_client, prefix, ["http://local:30000"], settings, resolver=resolver)
    fleet.seed()
    fleet.add("http://10.1.0.9:30000")
    assert fleet.refresh() == [
        "http://10.1.0.4:30000",
        "http://10.1.0.5:30000",
        "http://10.1.0.9:30000",
        "http://local:30000",
    ]
    resolver.addrs = ["10.1.0.4", "10.1.0.6"]  # pod .5 went away, pod .6 became ready
    assert fleet.refresh() == [
        "http://10.1.0.4:30000",
        "http://10.1.0.6:30000",
        "http://10.1.0.9:30000",
        "http://local:30000",
    ]
    assert fleet.members()["http://10.1.0.9:30000"] == "admin"  # other sources untouched
    resolver.fail = True  # DNS down: nothing is dropped
    assert len(fleet.refresh()) == 4


def test_resolve_dns_brackets_ipv6_and_drops_repeats():
    urls = resolve_dns("engine", 30000, "http", Resolver("fd00::2", "10.0.0.1"))
    assert urls == ["http://10.0.0.1:30000", "http://[fd00::2]:30000"]


def test_weight_version_is_zero_until_set(redis_client, prefix):
    fleet = Fleet(redis_client, prefix, [])
    assert fleet.version() == 0
    fleet.set_version(7)
    assert Fleet(redis_client, prefix, []).version() == 7


def test_dns_discovery_without_a_name_is_refused_at_start():
    with pytest.raises(ValidationError, match="dns_name"):
        load_settings(fleet={"discovery": "dns"})
    with pytest.raises(ValidationError, match="refresh_sec"):
        load_settings(fleet={"refresh_sec": 1})
