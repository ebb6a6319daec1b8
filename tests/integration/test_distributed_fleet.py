"""The distributed weight push (`trainer.push.mode = "distributed"`, gloo) following a changing
fleet, through real parts: engine processes (tiny model; one joins as two TP ranks,
`engine.emulate_tp_size = 2`), real Redis, a real gateway process and the trainer.

- Two engines form the group with the trainer; a third is registered mid-run. The gateway holds
  it pending (it serves an older version than the one the broadcast recorded); the trainer's
  fleet watcher writes the kept broadcast snapshot once and loads it on that engine alone;
  only then is the engine in service, and its first request runs on the current version. Its
  tensors equal, bit for bit, those the broadcast put on the others. The next push re-forms the
  group with it: SGLang's rank offsets recomputed in the fleet's sorted order (world
  1+1+1+2 = 5).
- An engine removed from the fleet: the next push re-forms the group without it (world
  1+1+2 = 4) and reaches the others; the removed engine keeps what it had.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager

import httpx
import pytest
from prometheus_client import REGISTRY
from safetensors.torch import load_file

from flywheel.core.auth import KeyStore
from flywheel.core.fleet import Fleet
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.gateway.engines.pool import rendezvous_order
from flywheel.ops.stack import Stack
from flywheel.trainer.service import build_trainer

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WAIT_S = 600
"""Generous waits (engine start, HTTP answers) for a busy machine; nothing is timed."""
NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]


def served(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=WAIT_S).json()["weight_version"]


def tensors(url: str) -> dict[str, list]:
    """Some parameters as the engine serves them (float32 lists; the embedding's first 4
    rows), compared exactly."""
    out = {}
    for name in NAMES:
        rows = 4 if "embed_tokens" in name else 10**6
        body = {"name": name, "truncate_size": rows}
        r = httpx.post(f"{url}/get_weights_by_name", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        out[name] = r.json()
    return out


def rows(url: str) -> float:
    """Finished /generate rows of one engine (its own counter)."""
    text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    name = "flywheel_engine_requests_total"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


@contextmanager
def started_together(*engines: AbstractContextManager[str]) -> Iterator[list[str]]:
    """Start the engine processes at once (on a busy machine each start is mostly waiting);
    yields their URLs and stops every one that started."""
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(engines)) as pool:
            futures = [pool.submit(engine.__enter__) for engine in engines]
        urls, errors = [], []
        for engine, future in zip(engines, futures, strict=True):
            try:
                urls.append(future.result())
            except BaseException as exc:  # raised below, once the others are registered
                errors.append(exc)
            else:
                stack.push(engine.__exit__)
        if errors:
            raise errors[0]
        yield urls


def reforms(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "flywheel_trainer_push_group_reforms_total", {"reason": reason}
    )
    return value or 0.0


@pytest.mark.timeout(3600)  # engine starts take minutes when the 2-core machine is shared
def test_a_joined_engine_gets_the_broadcast_weights_first_and_the_group_follows_the_fleet(
    tmp_path, tiny_model_dir, redis_server, prefix
):
    with started_together(
        engine_process(tiny_model_dir, context_length="256", startup_s=WAIT_S),
        engine_process(tiny_model_dir, context_length="256", startup_s=WAIT_S),
        engine_process(tiny_model_dir, context_length="256", emulate_tp_size="2", startup_s=WAIT_S),
    ) as (a, b, c):
        tp = {a: 1, b: 1, c: 2}

        def checkpointed(step: int) -> dict[str, list]:
            """The trainer's weights of `step` (its fp32 checkpoint), as `tensors` lists them."""
            state = load_file(tmp_path / "ckpt" / f"step_{step:08d}" / "model.safetensors")
            return {n: state[n][: 4 if "embed_tokens" in n else None].tolist() for n in NAMES}

        def layout(*members: str) -> tuple[list[str], list[int], int]:
            """(engines in the fleet's sorted order, SGLang's rank offsets, world size): the
            trainer is rank 0, each engine's offset is 1 + the TP sizes before it."""
            urls = sorted(members)
            offsets = [1 + sum(tp[u] for u in urls[:i]) for i in range(len(urls))]
            return urls, offsets, 1 + sum(tp[u] for u in urls)

        sections = {
            "redis": {"url": redis_server.url},
            "streams": {"prefix": prefix, "block_ms": 200},
            "engine": {"model_path": str(tiny_model_dir)},
            "gateway": {
                "port": free_port(),
                "engine_urls": [a, b],
                "default_max_tokens": 4,
                "security": {"auth": "on"},
            },
            "trainer": {
                "model_path": str(tiny_model_dir),
                "port": free_port(),
                "checkpoint": {"dir": str(tmp_path / "ckpt")},
                "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
                "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
                "batch": {"group_size": 2, "groups_per_step": 1},
                "optim": {"lr": 1e-2},
                "push": {"mode": "distributed", "attempts": 1, "timeout_s": WAIT_S},
            },
            "state_dir": str(tmp_path / "state"),
        }
        # the trainer's watcher is stepped by hand below; the gateway reads the fleet often
        trainer = build_trainer(load_settings(**sections, fleet={"refresh_s": 3600}))
        pusher = trainer.parts.pusher
        fleet = Fleet(connect(redis_server.url), prefix, [])
        keys = KeyStore(connect(redis_server.url), prefix)
        agent, _ = keys.create("agent", "agent")
        admin, _ = keys.create("admin", "ops")
        joined_before, left_before = reforms("joined"), reforms("left")
        gateway_settings = load_settings(**sections, fleet={"refresh_s": 0.3})
        with Stack(gateway_settings, echo=lambda _: None, only=("gateway",)) as stack:
            gw = stack.services[0].url
            assert trainer.run(max_steps=1) == 1
            assert trainer.last_push_via == "distributed"
            group = pusher.sync
            assert group is not None
            # a and b in either order: offsets 1 and 1+1 = 2, world 1+1+1 = 3
            assert (group.engine_urls, group.rank_offsets, group.world_size) == layout(a, b)
            assert layout(a, b)[1:] == ([1, 2], 3)
            assert served(a) == served(b) == "1" and served(c) == "default"
            assert fleet.version() == 1  # recorded by the broadcast: gateways hold back less
            assert pusher.latest_snapshot is not None and pusher.latest_snapshot[0] == 1
            v1 = tensors(a)
            assert tensors(b) == v1

            assert fleet.add(c)  # registered mid-run (what the admin route and CLI do)
            session = next(
                s for s in (f"s-{i}" for i in range(1000)) if rendezvous_order([a, b, c], s)[0] == c
            )

            def chat() -> None:
                r = httpx.post(
                    f"{gw}/v1/chat/completions",
                    json={"model": "any", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {agent}", "X-Session-Id": session},
                    timeout=WAIT_S,
                )
                assert r.status_code == 200, r.text

            def state_of_c() -> tuple[str, int] | None:
                listing = httpx.get(
                    f"{gw}/v1/admin/engines",
                    headers={"Authorization": f"Bearer {admin}"},
                    timeout=WAIT_S,
                ).json()["data"]
                return next(
                    ((e["state"], e["weight_version"]) for e in listing if e["url"] == c), None
                )

            deadline = time.monotonic() + WAIT_S
            while state_of_c() in (None, ("unseen", 0)):  # the gateway reads it every 0.3 s
                assert time.monotonic() < deadline, "the gateway never saw c"
                time.sleep(0.3)
            assert state_of_c() == ("pending", 0)  # it serves less than the fleet's version 1
            chat()  # c's session is served by a or b meanwhile
            assert rows(c) == 0

            assert pusher.disk.watcher.check() == {c: None}  # by disk, from the kept snapshot
            folder = tmp_path / "ckpt" / "joiners" / "weights" / "v_00000001"
            assert (folder / "model.safetensors").is_file()
            assert served(c) == "1" and rows(c) == 0  # current weights before any request
            assert tensors(c) == v1  # bit for bit what the broadcast gave a and b
            assert served(a) == served(b) == "1"  # the others were left as they were

            deadline = time.monotonic() + WAIT_S
            while True:
                before = rows(c)
                chat()
                if rows(c) > before:  # c's first request ran on version 1
                    break
                assert time.monotonic() < deadline, "the gateway never routed to c"
                time.sleep(0.3)
            assert rows(c) == 1

            # the next push re-forms the group with c (two ranks) where the sorted order puts
            # it: last = offsets 1, 2, 3; first = 1, 3, 4; between = 1, 2, 4; world 1+1+1+2 = 5
            assert trainer.run(max_steps=1) == 1
            assert trainer.last_push_via == "distributed"
            group = pusher.sync
            assert (group.engine_urls, group.rank_offsets, group.world_size) == layout(a, b, c)
            assert layout(a, b, c)[1] in ([1, 2, 3], [1, 3, 4], [1, 2, 4])
            assert layout(a, b, c)[2] == 5
            assert reforms("joined") == joined_before + 1
            assert served(a) == served(b) == served(c) == "2"
            v2 = tensors(a)
            assert v2 == checkpointed(2) and tensors(b) == v2 and tensors(c) == v2

            # b removed: the next push re-forms without it: a 1 | c 2,3 or c 1,2 | a 3 of
            # 1+1+2 = 4
            assert fleet.remove(b)
            assert trainer.run(max_steps=1) == 1
            assert trainer.last_push_via == "distributed"
            group = pusher.sync
            assert (group.engine_urls, group.rank_offsets, group.world_size) == layout(a, c)
            assert layout(a, c)[1:] in (([1, 2], 4), ([1, 3], 4))
            assert reforms("left") == left_before + 1
            assert served(a) == served(c) == "3" and served(b) == "2"
            v3 = tensors(a)
            assert v3 == checkpointed(3) and tensors(c) == v3 and tensors(b) == v2
        trainer.close()
