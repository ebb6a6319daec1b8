"""Settings of the policy engine (`[engine]`, a section of `flywheel.core.settings`): which engine
`flywheel up` runs (`backend`) and how it serves.

Backends (docs/engine-protocol.md "Engine backends"):
- "embedded": `python -m flywheel.engine`, this package's engine on transformers (CPU or one GPU).
- "sglang": `flywheel up` launches `python -m sglang.launch_server` (the `flywheel[sglang]`
  extra, or `sglang_launcher`) with the flags these settings map to (`flywheel.ops.engine_launch`).
- "external": `flywheel up` starts no engine and attaches to `urls` (servers it did not start).

A setting the chosen backend has no use for is refused at start when it differs from its
default, so every accepted setting takes effect.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from flywheel.core.judge_settings import DEFAULT_MODEL_NAME
from flywheel.core.section import Section

BACKENDS = ("embedded", "sglang", "external")
"""The values of `engine.backend`."""

_EMBEDDED_ONLY = ("batch_wait_ms", "threads", "weight_swap", "emulate_tp_size", "grammar_logprobs")
"""Settings only the embedded engine reads (SGLang has its own flags: `sglang_args`)."""
_LAUNCHED_ONLY = (
    "host",
    "port",
    "device",
    "max_batch_size",
    "seed",
    "allow_longer_context",
    "weight_version",
    "tp_size",
)
"""Settings of an engine `flywheel up` starts: no use with `backend = "external"`."""


class EngineSettings(Section):
    backend: Literal["embedded", "sglang", "external"] = "embedded"
    """Which engine `flywheel up` runs: "embedded" (`flywheel.engine`), "sglang" (launches
    `python -m sglang.launch_server` with the flags below; install `flywheel[sglang]` on the GPU
    machine) or "external" (starts none and attaches to `urls`, waiting for their `/health`)."""
    urls: list[str] = Field(default_factory=list)
    """Engines `backend = "external"` attaches to (SGLang servers or one SGLang router, e.g.
    ["http://gpu-1:30000"]); required there, refused with the other backends."""
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    """SGLang's default port."""
    model_path: str = ""
    """Hugging Face folder to serve; empty = SmolLM2-135M-Instruct converted from the GGUF."""
    served_model_name: str = DEFAULT_MODEL_NAME
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype; bf16 is faster, fp32 matches the trainer's logprobs exactly."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when a GPU is visible, else CPU."""
    max_batch_size: int = Field(64, ge=1)
    """Rows in the running batch at once (continuous batching: rows join between steps);
    SGLang's `--max-running-requests` when set."""
    max_queued_requests: int = Field(256, ge=0)
    """Rows that may wait for the running batch (SGLang's `--max-queued-requests`); a request
    that would queue more is refused at once (503; the gateway answers its client 503 with
    Retry-After in the API's error format) instead of waiting past the gateway's
    `request_timeout_s`; 0 = unbounded."""
    batch_wait_ms: float = Field(20.0, ge=0)
    """Milliseconds an idle engine waits for more requests before the first prefill."""
    context_length: int = Field(2048, ge=16)
    """Tokens (prompt + completion) per request; at most the model's trained length
    (`max_position_embeddings`) unless `allow_longer_context` (docs/engine-protocol.md)."""
    allow_longer_context: bool = False
    """Serve a `context_length` above the model's trained length (logged as a warning), like
    SGLang's `--context-length` with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (that variable
    is honoured too, and set for a launched SGLang). False: such a setting stops the engine at
    start."""
    weight_version: str = "default"
    """Initial weight version label (SGLang's `--weight-version`)."""
    weight_swap: Literal["step", "drain"] = "step"
    """How a weight update meets rows in flight: "step" swaps at the next decode-step boundary
    (running rows continue under the new weights, their tokens carry the new version from the
    swap on, nothing waits); "drain" holds new rows until every row in flight has finished on
    the old weights, then swaps (one version per request; new rows wait for the longest one)."""
    seed: int = 0
    """Sampling seed of requests without one (SGLang's `--random-seed`)."""
    threads: int = Field(0, ge=0)
    """torch threads; 0 = torch's default."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel GPUs per engine (SGLang's `--tp-size`); the embedded engine runs 1."""
    emulate_tp_size: int = Field(1, ge=1, le=64)
    """Embedded engine only: the ranks it joins a weight-update group with, and the `tp_size`
    its /server_info reports, as an SGLang server with `--tp-size N` does, so a trainer's rank
    layout for TP engines can be exercised on CPU. The model is still computed once, on one
    device; the extra ranks receive every broadcast and must get the first rank's bytes, or
    the update fails."""
    grammar_logprobs: Literal["unmasked", "renormalized"] = "unmasked"
    """Embedded engine only: the logprob a grammar-constrained token (json_schema / regex /
    ebnf / structural_tag) is reported with. "unmasked": the model's `log_softmax(logits /
    T)[t]`, what the trainer recomputes, and the answer says so (`meta_info.grammar_logprobs`).
    "renormalized": the logprob over the grammar's allowed tokens only, without that note, as
    SGLang 0.5.23 reports it (its vocabulary mask is applied before its log-softmax), so the
    SGLang path (the gateway's `Sample.logprob_renormalized` marks) can be exercised on CPU
    (docs/token-path.md, "Constrained tokens")."""
    sglang_args: list[str] = Field(default_factory=list)
    """More SGLang flags, passed as given after the ones Flywheel sets, e.g.
    ["--mem-fraction-static", "0.85", "--tool-call-parser", "qwen25"]; backend "sglang" only."""
    sglang_launcher: list[str] = Field(default_factory=list)
    """The command SGLang's flags follow; empty = this Python with `-m sglang.launch_server`.
    E.g. ["/opt/sglang/bin/python", "-m", "sglang.launch_server"] for SGLang in its own
    environment. Backend "sglang" only."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds `flywheel up` waits for each engine to answer `/health` (SGLang loading a large
    model and capturing CUDA graphs can take longer than the default)."""

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine.urls: {url!r} is not an http(s):// URL")
        return [url.rstrip("/") for url in v]

    @model_validator(mode="after")
    def _settings_of_the_backend(self) -> EngineSettings:
        b = self.backend
        if b == "external" and not self.urls:
            raise ValueError(
                'engine.backend = "external" attaches to running engines: list them in '
                'engine.urls (e.g. ["http://gpu-1:30000"])'
            )
        if b != "external" and self.urls:
            raise ValueError(
                f'engine.urls name engines to attach to, but engine.backend is "{b}", which '
                'starts its own: set engine.backend = "external" or remove engine.urls'
            )
        if b != "sglang":
            for name in ("sglang_args", "sglang_launcher"):
                if getattr(self, name):
                    raise ValueError(f'engine.{name} applies to engine.backend = "sglang" only')
        if b == "embedded" and self.tp_size != 1:
            raise ValueError(
                'engine.tp_size > 1 needs engine.backend = "sglang" (the embedded engine runs '
                "one rank)"
            )
        unused = {"embedded": (), "sglang": _EMBEDDED_ONLY}.get(b, _EMBEDDED_ONLY + _LAUNCHED_ONLY)
        defaults = type(self).model_fields
        changed = [n for n in unused if getattr(self, n) != defaults[n].default]
        if changed:
            raise ValueError(
                f'engine.backend = "{b}" has no use for '
                f"{', '.join(f'engine.{n}' for n in changed)}; remove "
                f"{'it' if len(changed) == 1 else 'them'}"
                + (" (pass SGLang's own flags in engine.sglang_args)" if b == "sglang" else "")
            )
        if b == "external" and not self.model_path:
            raise ValueError(
                'engine.backend = "external" needs engine.model_path: the folder of the model '
                "the attached engines serve (the gateway tokenizes with it, the trainer starts "
                "from it); the default SmolLM2 would silently tokenize for another model"
            )
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
