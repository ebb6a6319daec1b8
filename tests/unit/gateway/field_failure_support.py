"""Shared pieces of the gateway field-failure tests: a scripted engine, generations and an app."""

from flywheel.gateway.engines.generation import Generation

from .harness import gateway_app

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 16}
EOS = 2  # <|im_end|> of the SmolLM2 tokenizer


def make_gen(ids, text, finish="stop", matched=EOS, version=1):
    """A Generation of `ids` (every logprob -0.5) as the engine client would return it."""
    return Generation(
        output_ids=ids,
        output_logprobs=[-0.5] * len(ids),
        text=text,
        finish_type=finish,
        matched_eos=finish == "stop" and ids[-1:] == [EOS],
        weight_version=version,
        prompt_tokens=0,
        matched=matched,
    )


class ScriptedEngine:
    """Returns one fixed generation; records every call."""

    def __init__(self, gen):
        self.gen, self.calls = gen, []

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        self.calls.append((list(input_ids), dict(sampling_params), top_logprobs_num))
        return self.gen


def scripted_app(redis_client, prefix, renderer):
    """(client, use(gen) -> ScriptedEngine, samples()) over a gateway with a scripted engine."""
    client, deps, samples = gateway_app(redis_client, prefix, renderer, ScriptedEngine(None))

    def use(gen):
        deps.engines = ScriptedEngine(gen)
        return deps.engines

    return client, use, samples


def run_episode(client, body, samples):
    """One episode session with one chat turn, finished: (the response, the last Sample)."""
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    resp = client.post(f"/s/{sid}/v1/chat/completions", json=body)
    client.post(f"/v1/sessions/{sid}/finish", json={})
    return resp, samples()[-1]
