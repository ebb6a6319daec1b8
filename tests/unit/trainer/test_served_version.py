"""The trainer reads the weight version an engine serves on every SGLang release the gateway
supports (docs: /work/shared facts, engine-protocol.md): `/model_info` (0.5.12+), else
`/get_model_info` (all releases; `weight_version` in it since 0.5.5, absent in 0.4.x)."""

from __future__ import annotations

import httpx

from flywheel.trainer.weights import WeightPusher


def pusher_for(routes: dict[str, httpx.Response]) -> tuple[WeightPusher, list[str]]:
    """A pusher whose engine answers `routes` (path -> response) and 404 elsewhere, as FastAPI
    answers a path it has no route for."""
    asked: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return routes.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))

    client = httpx.Client(transport=httpx.MockTransport(engine))
    return WeightPusher(["http://e1"], timeout_s=5, attempts=1, client=client), asked


def test_model_info_first():  # SGLang 0.5.12+ and the embedded engine
    pusher, asked = pusher_for(
        {
            "/model_info": httpx.Response(200, json={"weight_version": "12"}),
            "/get_model_info": httpx.Response(200, json={"weight_version": "3"}),
        }
    )
    assert pusher.served_version("http://e1") == 12 and asked == ["/model_info"]


def test_get_model_info_when_model_info_is_missing():  # SGLang 0.5.5
    pusher, asked = pusher_for(
        {"/get_model_info": httpx.Response(200, json={"weight_version": "7"})}
    )
    assert pusher.served_version("http://e1") == 7
    assert asked == ["/model_info", "/get_model_info"]


def test_a_release_without_weight_version_reads_as_the_initial_weights():  # SGLang 0.4.10
    info = {"model_path": "m", "tokenizer_path": "m", "is_generation": True}
    pusher, _ = pusher_for({"/get_model_info": httpx.Response(200, json=info)})
    assert pusher.served_version("http://e1") == 0  # below every pushed version: pushed


def test_an_engine_that_cannot_say_gives_none():
    pusher, asked = pusher_for({"/model_info": httpx.Response(503, text="starting")})
    assert pusher.served_version("http://e1") is None and asked == ["/model_info"]
    pusher, _ = pusher_for({})  # neither route
    assert pusher.served_version("http://e1") is None

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = httpx.Client(transport=httpx.MockTransport(down))
    pusher = WeightPusher(["http://e1"], timeout_s=5, attempts=1, client=client)
    assert pusher.served_version("http://e1") is None
