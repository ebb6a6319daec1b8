"""`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel` through the official
`openai` SDK (scripted engine, real tokenizer, real Redis): the input items are the stored
conversation the response answered, in OpenAI's list object, newest first by default, paged by
`limit` and `after`; cancel is OpenAI's 400 for a response not created in background mode; an
unknown, unstored or another key's id is a 404 on both."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .test_responses_api import CALL, TOOL, gw, renderer, sdk  # noqa: F401  (fixtures)


def test_input_items_list_the_conversation_the_response_answered(gw):
    make, _, _ = gw
    client, _ = make([CALL, "It is 8."])
    api = sdk(client)
    r1 = api.responses.create(model="m", input="What is 7 + 1?", tools=[TOOL])
    (call,) = r1.output
    r2 = api.responses.create(
        model="m",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "8"}],
        tools=[TOOL],
    )
    listed = api.responses.input_items.list(r2.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), ("function_call", None), ("function_call_output", None)]
    user, fc, out = listed.data
    assert user.content[0].text == "What is 7 + 1?"
    assert (fc.call_id, fc.name) == (call.call_id, "add") and fc.arguments == call.arguments
    assert (out.call_id, out.output) == (call.call_id, "8")
    assert listed.has_more is False
    assert (listed.first_id, listed.last_id) == (user.id, out.id)

    newest_first = api.responses.input_items.list(r2.id)  # OpenAI's default order: desc
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(listed.data)]
    page = api.responses.input_items.list(r2.id, order="asc", limit=1)
    assert [i.id for i in page.data] == [user.id] and page.has_more is True
    rest = api.responses.input_items.list(r2.id, order="asc", after=user.id)
    assert [i.id for i in rest.data] == [fc.id, out.id] and rest.has_more is False
    auto = [i.id for i in api.responses.input_items.list(r2.id, order="asc", limit=1)]
    assert auto == [user.id, fc.id, out.id]  # the SDK's auto-pagination follows `after`

    first = api.responses.input_items.list(r1.id)
    assert [i.type for i in first.data] == ["message"]  # its own reply is output, not input
    raw = client.get(f"/v1/responses/{r1.id}/input_items").json()
    assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"}
    assert raw["object"] == "list"


def test_input_items_of_unknown_unstored_or_foreign_ids_are_404(gw, redis_client, prefix):
    from flywheel.gateway.api.responses_store import ResponseStore, StoredResponse

    make, _, _ = gw
    client, _ = make(["a"])
    api = sdk(client)
    unstored = api.responses.create(model="m", input="x", store=False)
    store = ResponseStore(redis_client, prefix, 60)
    theirs = [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "ok"}]
    asyncio.run(store.put("resp_theirs", StoredResponse("other-key", "", theirs)))
    for response_id in ("resp_missing", unstored.id, "resp_theirs"):
        with pytest.raises(openai.NotFoundError) as err:
            api.responses.input_items.list(response_id)
        assert err.value.body["type"] == "not_found_error", err.value.body
        assert response_id in err.value.body["message"]
        reply = client.post(f"/v1/responses/{response_id}/cancel")
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    bad = client.get("/v1/responses/resp_theirs/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_cancel_is_openais_400_for_a_response_not_made_in_background(gw):
    make, _, _ = gw
    client, _ = make(["Eight."])
    api = sdk(client)
    made = api.responses.create(model="m", input="What is 7 + 1?")
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.cancel(made.id)
    assert err.value.status_code == 400
    assert err.value.body == {
        "message": "Cannot cancel a synchronous response.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert api.responses.retrieve(made.id).status == "completed"  # left as it was
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    assert client.post(f"/s/{sid}/v1/responses/{made.id}/cancel").status_code == 400
    assert client.get(f"/s/{sid}/v1/responses/{made.id}/input_items").status_code == 200
