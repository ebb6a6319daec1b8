"""Rendezvous (HRW) session affinity of the engine pool: adding an engine moves about 1/N of the
sessions, removing one moves only its own; the pool follows fleet membership."""

from __future__ import annotations

import hashlib

from flywheel.gateway.engines.pool import EnginePool, rendezvous_order

ENGINES = [f"http://10.0.0.{i}:30000" for i in range(1, 6)]
KEYS = [f"session-{i}" for i in range(10_000)]


def first(urls: list[str]) -> dict[str, str]:
    return {k: rendezvous_order(urls, k)[0] for k in KEYS}


def test_adding_a_fifth_engine_moves_about_a_fifth_of_the_sessions_all_to_it():
    before, after = first(ENGINES[:4]), first(ENGINES)
    moved = [k for k in KEYS if before[k] != after[k]]
    # A key moves only when the new engine outscores the 4 others: probability 1/5, so of
    # 10000 keys about 2000 move (binomial sd = sqrt(10000 * 0.2 * 0.8) = 40 keys = 0.004).
    # The bound 0.2 +- 0.02 is 5 sd wide; a plain modulo (sha1 % N) moves 1 - 1/5 = 80%.
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.02, len(moved)
    assert {after[k] for k in moved} == {ENGINES[4]}  # every moved key went to the new one
    # the four old engines keep an even share: about 2000 each (8000 / 4), within 5 sd
    # (sd = sqrt(10000 * 0.2 * 0.8) = 40)
    for url in ENGINES[:4]:
        assert abs(sum(v == url for v in after.values()) - 2000) < 200


def test_removing_an_engine_moves_only_its_own_sessions():
    before, after = first(ENGINES), first(ENGINES[:2] + ENGINES[3:])
    removed = ENGINES[2]
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == removed}
    # its ~1/5 of the keys spread over the 4 others: about 500 each (2000 / 4)
    assert abs(len(moved) - 2000) < 200
    for url in ENGINES[:2] + ENGINES[3:]:
        assert abs(sum(after[k] == url for k in moved) - 500) < 150


def test_plain_modulo_moves_most_sessions_where_rendezvous_moves_a_fifth():
    """The comparison the module docstring states: sha1 modulo N, as the pool did before."""

    def modulo(urls: list[str], k: str) -> str:
        return urls[int(hashlib.sha1(k.encode()).hexdigest(), 16) % len(urls)]

    moved = sum(modulo(ENGINES[:4], k) != modulo(ENGINES, k) for k in KEYS)
    # a key stays only when h % 4 == h % 5, i.e. h % 20 in {0, 1, 2, 3}: 4/20 = 1/5 stay
    assert abs(moved / len(KEYS) - 4 / 5) < 0.02


def test_pool_follows_the_fleet_and_never_routes_to_a_pending_engine():
    pool = EnginePool(ENGINES[:2], 5.0, set())
    joined, left = pool.set_members(ENGINES[:3])
    assert joined == [ENGINES[2]] and left == []
    assert ENGINES[2] in pool.pending
    assert all(ENGINES[2] not in pool.order(k) for k in KEYS[:500])
    pool.admit(ENGINES[2], 3)
    assert not pool.pending
    owned = [k for k in KEYS[:500] if pool.order(k)[0] == ENGINES[2]]
    assert 100 < len(owned) < 250  # about a third of 500 (sd ~ 10.5)
    joined, left = pool.set_members(ENGINES[1:3])
    assert joined == [] and left == [ENGINES[0]]
    assert all(ENGINES[0] not in pool.order(k) for k in KEYS[:100])
    assert all(pool.order(k)[0] == ENGINES[2] for k in owned)  # its sessions did not move
