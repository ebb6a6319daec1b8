"""The engines of the local stack (`flywheel up`), per `engine.backend`.

- "embedded": `python -m flywheel.engine` (and a second one for the teacher).
- "sglang": `python -m sglang.launch_server` (or `engine.sglang_launcher`) with the flags the
  engine protocol needs, built from the `[engine]` settings by `sglang_command`, then
  `engine.sglang_args` as given. SGLang release the flags and routes were checked against:
  `SGLANG_RELEASE` (the `flywheel[sglang]` extra pins it).
- "external": no engine is started; `wait_attached` waits until every `engine.urls` answers
  `/health` with 200.

Each launched engine is health-gated like every service of the stack (`/health` 200 from the
engine's own process); one that exits is reported with the tail of its log
(`Service.exit_report`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from flywheel.core.engine_settings import EngineSettings
from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import FlywheelSettings
from flywheel.ops.service import Service, engine_failed, http_ok

SGLANG_RELEASE = "0.5.23"
"""The SGLang release whose server flags and HTTP API Flywheel follows (docs/engine-protocol.md);
`pip install 'flywheel[sglang]'` installs it."""
SGLANG_MODULE = "sglang.launch_server"
ENGINE_SERVICES = ("engine", "teacher-engine")
WAIT_PROGRESS_S = 15.0
"""Seconds between the progress lines of `flywheel up` waiting for an external engine."""
SGLANG_FIX = (
    "SGLang runs from engine.sglang_launcher, else this Python: install it there with "
    f"pip install 'flywheel[sglang]' (sglang=={SGLANG_RELEASE}); check engine.sglang_args"
)


def sglang_command(
    engine: EngineSettings,
    *,
    model_path: str,
    port: int,
    served_model_name: str,
    weight_version: str = "default",
    python: str = sys.executable,
) -> list[str]:
    """The command line that starts an SGLang server for `engine`.

    Flags: `--model-path`, `--served-model-name`, `--host`/`--port`, `--context-length`,
    `--weight-version`, `--tp-size`, `--dtype`, `--random-seed` (`engine.seed`),
    `--grammar-backend xgrammar` (the gateway sends xgrammar structural tags for forced tool
    calls), `--enable-metrics` (the engine's `/metrics`), `--device` unless `engine.device` is
    "auto", `--max-running-requests` when `engine.max_batch_size` is not its default,
    `--max-queued-requests` unless `engine.max_queued_requests` is 0 (SGLang's own queue is
    unbounded); then
    `engine.sglang_args` as given. Streaming stays cumulative (no
    `--incremental-streaming-output`) and the tokenizer stays on (no `--skip-tokenizer-init`):
    the gateway reads the text and ids of the final chunk.

    Args:
        engine: the `[engine]` settings (backend "sglang").
        model_path: Hugging Face folder or hub id to serve.
        port: TCP port to bind on `engine.host`.
        served_model_name: the model name SGLang reports (`/v1/models`, `/model_info`).
        weight_version: the initial weight version label.
        python: the interpreter that runs `-m sglang.launch_server` when
            `engine.sglang_launcher` is empty.

    Returns:
        argv, e.g. `[python, "-m", "sglang.launch_server", "--model-path", "/m", ...]`.
    """
    launcher = engine.sglang_launcher or [python, "-m", SGLANG_MODULE]
    args = [
        "--model-path", model_path,
        "--served-model-name", served_model_name,
        "--host", engine.host,
        "--port", str(port),
        "--context-length", str(engine.context_length),
        "--weight-version", weight_version,
        "--tp-size", str(engine.tp_size),
        "--dtype", engine.dtype,
        "--random-seed", str(engine.seed),
        "--grammar-backend", "xgrammar",
        "--enable-metrics",
    ]  # fmt: skip
    if engine.device != "auto":
        args += ["--device", engine.device]
    if engine.max_batch_size != EngineSettings.model_fields["max_batch_size"].default:
        args += ["--max-running-requests", str(engine.max_batch_size)]
    if engine.max_queued_requests:  # SGLang's own default is an unbounded queue
        args += ["--max-queued-requests", str(engine.max_queued_requests)]
    return [*launcher, *args, *engine.sglang_args]


def sglang_env(engine: EngineSettings) -> dict[str, str]:
    """Environment variables a launched SGLang server needs for `engine`: SGLang reads two
    switches only from the environment: `SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`
    (`engine.allow_longer_context`: a `--context-length` above the model's trained length) and
    `SGLANG_USE_CPU_ENGINE=1` (`engine.device = "cpu"`)."""
    env = {}
    if engine.allow_longer_context:
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    if engine.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def policy_engine(settings: FlywheelSettings) -> Service | None:
    """The policy engine `flywheel up` starts (on `engine.host`/`engine.port`), or None with
    backend "external" (it attaches to `engine.urls` instead)."""
    e = settings.engine
    url = e.url
    if e.backend == "external":
        return None
    if e.backend == "embedded":
        return Service(
            "engine",
            url,
            "flywheel.engine",
            http_ok(f"{url}/health"),
            failed=engine_failed(url, f"loading the model {e.model_path} failed"),
            fix="check [engine] model_path (FLYWHEEL_ENGINE__MODEL_PATH)",
        )
    command = sglang_command(
        e,
        model_path=e.model_path,
        port=e.port,
        served_model_name=e.served_model_name,
        weight_version=e.weight_version,
    )
    return Service(
        "engine",
        url,
        SGLANG_MODULE,
        http_ok(f"{url}/health"),
        command=command,
        env=sglang_env(e),
        fix=SGLANG_FIX,
    )


def teacher_engine(settings: FlywheelSettings, port: int) -> Service:
    """The local stack's teacher engine on `port`: a frozen copy of `teacher.model_path` (default
    the policy's model), of the same backend as the policy engine, never given weight pushes.

    Raises:
        ConfigurationError: backend "external" (the stack starts no engine then: name the
            teacher's in `teacher.engine_urls`, or set `teacher.self_teacher`).
    """
    e, t = settings.engine, settings.teacher
    model = t.model_path or e.model_path
    url = f"http://{e.host}:{port}"
    if e.backend == "external":
        raise ConfigurationError(
            'engine.backend = "external" starts no engine, also none for the teacher: list the '
            "teacher's engines in teacher.engine_urls, or set teacher.self_teacher = true"
        )
    if e.backend == "sglang":
        name = t.model_name or Path(model).name
        command = sglang_command(e, model_path=model, port=port, served_model_name=name)
        return Service(
            "teacher-engine",
            url,
            SGLANG_MODULE,
            http_ok(f"{url}/health"),
            command=command,
            env=sglang_env(e),
            fix=SGLANG_FIX,
        )
    return Service(
        "teacher-engine",
        url,
        "flywheel.engine",
        http_ok(f"{url}/health"),
        args=["--port", str(port), "--model-path", model],
        failed=engine_failed(url, f"loading the teacher model {model} failed"),
        fix="check [teacher] model_path (FLYWHEEL_TEACHER__MODEL_PATH)",
    )


def wait_attached(
    urls: list[str],
    engine: EngineSettings,
    timeout_s: float,
    echo: Callable[[str], None],
    progress_s: float = WAIT_PROGRESS_S,
) -> None:
    """Wait until every engine `flywheel up` attaches to (backend "external") answers `/health`
    with 200, then check its server arguments (`check_server`); it starts none of them. An
    engine that does not answer at once gets a `waiting for <url>/health (up to N s)` line
    through `echo`, then one line every `progress_s` seconds while the wait goes on.

    Raises:
        TimeoutError: one did not within `timeout_s` (the message names it and the setting).
        ConfigurationError: one runs with arguments Flywheel cannot work with.
    """
    for url in urls:
        start = time.monotonic()
        check = http_ok(f"{url}/health")
        said = 0.0  # seconds waited when the last progress line was printed
        if not check():
            echo(f"engine    waiting for {url}/health (up to {timeout_s:g} s)")
        while not check():
            waited = time.monotonic() - start
            if waited - said >= progress_s:
                said = waited
                echo(
                    f"engine    still waiting for {url}/health ({waited:.0f} s of {timeout_s:g} s)"
                )
            if waited > timeout_s:
                raise TimeoutError(
                    f"engine {url} did not answer /health with 200 within {timeout_s:g}s. "
                    'With engine.backend = "external" flywheel up starts no engine: start '
                    "it, or fix engine.urls (engine.startup_timeout_s sets the wait)"
                )
            time.sleep(0.5)
        check_server(url, engine)
        info = served_model(url)
        serves = f", serves {info.get('model_path')} version {info.get('weight_version')}"
        echo(
            f"engine    {url}  healthy ({time.monotonic() - start:.1f}s; attached, not started"
            f"{serves if info else ''})"
        )


def _info(url: str, paths: tuple[str, ...], http: httpx.Client | None) -> dict[str, Any]:
    """The first JSON object one of `paths` of `url` answers with 200 (newer SGLang routes
    first, then their legacy names); {} when none does."""
    for path in paths:
        try:
            reply = (http or httpx).get(f"{url}{path}", timeout=10)
            info = reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(info, dict):
            return info
    return {}


def served_model(url: str, http: httpx.Client | None = None) -> dict[str, Any]:
    """`/model_info` of the engine at `url` (`/get_model_info` on SGLang before 0.5.12)."""
    return _info(url, ("/model_info", "/get_model_info"), http)


def check_server(url: str, engine: EngineSettings, http: httpx.Client | None = None) -> None:
    """Refuse an engine whose server arguments (`/server_info`, `/get_server_info` before SGLang
    0.5.12) Flywheel cannot work with: a context length below `engine.context_length` (the
    gateway would pass prompts the engine refuses), incremental streaming (the gateway reads
    cumulative chunks), no tokenizer (`--skip-tokenizer-init`: no text in answers), or a grammar
    backend other than xgrammar (forced tool calls are xgrammar structural tags). Arguments the
    engine does not report are not checked.

    Raises:
        ConfigurationError: one or more of those, each with what to change.
    """
    info = _info(url, ("/server_info", "/get_server_info"), http)
    problems = []
    context = info.get("context_length")
    if isinstance(context, int) and context < engine.context_length:
        problems.append(
            f"its context length is {context}, below engine.context_length = "
            f"{engine.context_length}: set engine.context_length = {context}"
        )
    if info.get("incremental_streaming_output"):
        problems.append("it streams increments: run it without --incremental-streaming-output")
    if info.get("skip_tokenizer_init"):
        problems.append("it answers without text: run it without --skip-tokenizer-init")
    grammar = info.get("grammar_backend")
    if grammar not in (None, "xgrammar"):
        problems.append(f"its grammar backend is {grammar}: run it with --grammar-backend xgrammar")
    if problems:
        raise ConfigurationError(f"engine {url} cannot serve Flywheel: {'; '.join(problems)}")
