"""Schema fuzzing of the gateway's OpenAPI spec (schemathesis): no generated request, valid or
not, gets a 5xx. The app runs with a fake engine, real Redis and the real tokenizer; examples per
operation are bounded so the whole run stays within seconds."""

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore


class InstantEngine:
    """Replies "8" + EOS to anything."""

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        return Generation(
            output_ids=[28, 2],
            output_logprobs=[-0.5, -0.1],
            text="8",
            finish_type="stop",
            matched_eos=True,
            weight_version=0,
            prompt_tokens=len(input_ids),
        )


@pytest.fixture(scope="module")
def fuzz_app(smollm2_dir, redis_server):
    from flywheel.core.redis_client import connect

    client = connect(redis_server.url)
    deps = GatewayDeps(
        settings=GatewaySettings(),
        renderer=ChatRenderer(smollm2_dir),
        engines=InstantEngine(),
        sessions=SessionStore(client, "fuzz", 3600),
        publisher=StreamProducer(client, "fuzz:rollouts"),
    )
    return create_app(deps)


def test_no_generated_request_gets_a_server_error(fuzz_app):
    # The app serves a valid request (checked directly, before any generated request can create
    # an API key: whether one of the few generated examples happens to be valid depends on the
    # string constants Hypothesis harvests from the modules the test session imported).
    valid = TestClient(fuzz_app).post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "7 + 1?"}], "max_tokens": 4},
    )
    assert valid.status_code == 200, valid.text
    assert valid.json()["choices"][0]["message"]["content"] == "8"
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/sessions/{session_id}/reward"} <= paths
    # Key administration last: once a key exists, unauthenticated requests are refused (401).
    operations.sort(key=lambda op: "keys" in op.path)
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        for mode in GenerationMode:  # requests the schema allows, then ones it does not
            try:
                _fuzz(operation, mode, failures, statuses.setdefault(operation.path, set()))()
            except Unsatisfiable:  # nothing in this operation's schema to break (no body)
                assert mode is GenerationMode.NEGATIVE, operation.path
            except Exception as exc:  # collect every failing operation, then report them all
                failures.append(
                    f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}"[:500]
                )
    assert not failures, "\n".join(failures)
    assert 400 in statuses["/v1/chat/completions"]  # invalid requests were refused, not served


def _fuzz(operation, mode, failures, statuses):
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        response = case.call()
        statuses.add(response.status_code)
        if response.status_code >= 500:
            failures.append(
                f"{operation.method.upper()} {operation.path} -> "
                f"{response.status_code}: {response.text[:200]}"
            )
        case.validate_response(response, checks=[not_a_server_error])

    return check
