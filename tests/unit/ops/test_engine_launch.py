"""The engine backends of `flywheel up` (flywheel.ops.engine_launch): the SGLang command line and
environment built from `[engine]`, the settings each backend refuses, the `[sglang]` extra, and
the report of an engine that exits."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import load_settings, load_settings_or_exit
from flywheel.ops.engine_launch import (
    SGLANG_RELEASE,
    check_server,
    policy_engine,
    sglang_command,
    sglang_env,
    teacher_engine,
)
from flywheel.ops.service import Service
from flywheel.ops.stack import Stack

from ...sglang_standin import parse as standin_parse

ROOT = Path(__file__).resolve().parents[3]


def test_sglang_command_carries_every_engine_setting_sglang_has_a_flag_for():
    s = load_settings(
        engine={
            "backend": "sglang",
            "model_path": "/models/qwen",
            "served_model_name": "qwen-policy",
            "host": "0.0.0.0",
            "port": 30001,
            "context_length": 8192,
            "weight_version": "7",
            "tp_size": 2,
            "dtype": "bfloat16",
            "seed": 3,
            "device": "cuda",
            "max_batch_size": 32,
            "sglang_args": ["--mem-fraction-static", "0.85", "--tool-call-parser", "qwen25"],
        }
    )
    e = s.engine
    cmd = sglang_command(
        e, model_path=e.model_path, port=e.port, served_model_name=e.served_model_name,
        weight_version=e.weight_version, python="/venv/bin/python",
    )  # fmt: skip
    assert cmd == [
        "/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen",
        "--served-model-name", "qwen-policy",
        "--host", "0.0.0.0",
        "--port", "30001",
        "--context-length", "8192",
        "--weight-version", "7",
        "--tp-size", "2",
        "--dtype", "bfloat16",
        "--random-seed", "3",
        "--grammar-backend", "xgrammar",
        "--enable-metrics",
        "--device", "cuda",
        "--max-running-requests", "32",
        "--max-queued-requests", "256",
        "--mem-fraction-static", "0.85", "--tool-call-parser", "qwen25",
    ]  # fmt: skip
    # Every flag is one SGLang's parser (as the stand-in models it) reads, with the value given.
    args = standin_parse(cmd[3:])
    assert (args.model_path, args.served_model_name, args.port) == (
        "/models/qwen",
        "qwen-policy",
        30001,
    )
    assert (args.context_length, args.weight_version, args.tp_size) == (8192, "7", 2)
    assert (args.dtype, args.random_seed, args.max_running_requests) == ("bfloat16", 3, 32)
    assert args.max_queued_requests == 256  # engine.max_queued_requests: a fast 503 when full
    assert args.mem_fraction_static == 0.85 and args.tool_call_parser == "qwen25"
    assert sglang_env(e) == {}


def test_defaults_leave_sglang_its_own_device_and_batch_size_and_the_launcher_is_replaceable():
    s = load_settings(
        engine={
            "backend": "sglang",
            "sglang_launcher": ["/opt/sglang/bin/python", "-m", "sglang.launch_server"],
        }
    )
    cmd = sglang_command(s.engine, model_path="/m", port=30000, served_model_name="m")
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert "--device" not in cmd and "--max-running-requests" not in cmd
    assert cmd[cmd.index("--weight-version") + 1] == "default"


def test_sglang_reads_two_switches_from_the_environment_only():
    s = load_settings(engine={"backend": "sglang", "allow_longer_context": True, "device": "cpu"})
    assert sglang_env(s.engine) == {
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
        "SGLANG_USE_CPU_ENGINE": "1",
    }
    service = policy_engine(s)
    assert service is not None and service.env == sglang_env(s.engine)
    assert service.argv(sys.executable) == service.command


def test_a_misspelled_backend_is_refused_at_start_naming_the_choices(monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_ENGINE__BACKEND", "sglng")
    with pytest.raises(SystemExit) as exit_:
        load_settings_or_exit(prog="flywheel")
    message = str(exit_.value.code)
    assert "engine.backend" in message
    assert "'embedded', 'sglang' or 'external'" in message


@pytest.mark.parametrize(
    ("engine", "teacher", "refusal"),
    [
        ({"backend": "external"}, {}, "list them in engine.urls"),
        ({"urls": ["http://gpu:30000"]}, {}, 'set engine.backend = "external"'),
        ({"sglang_args": ["--x"]}, {}, 'engine.sglang_args applies to engine.backend = "sglang"'),
        (
            {"backend": "external", "urls": ["http://g:1"], "sglang_launcher": ["p"]},
            {},
            "sglang_launcher",
        ),
        ({"tp_size": 2}, {}, "engine.tp_size > 1 needs"),
        ({"backend": "sglang", "threads": 4}, {}, "has no use for engine.threads"),
        ({"backend": "sglang", "weight_swap": "drain"}, {}, "engine.weight_swap"),
        # SGLang reports renormalised grammar logprobs whatever this says (docs/token-path.md)
        ({"backend": "sglang", "grammar_logprobs": "renormalized"}, {}, "grammar_logprobs"),
        ({"backend": "external", "urls": ["http://g:1"], "port": 31000}, {}, "engine.port"),
        ({"backend": "external", "urls": ["ftp://g:1"]}, {}, "not an http(s):// URL"),
        (
            {"backend": "external", "urls": ["http://g:1"], "model_path": "/m"},
            {"enabled": True},
            "teacher.engine_urls",
        ),
        ({"backend": "external", "urls": ["http://g:1"]}, {}, "needs engine.model_path"),
    ],
)
def test_settings_a_backend_cannot_use_are_refused(engine, teacher, refusal):
    with pytest.raises(ValidationError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        load_settings(engine=engine, teacher=teacher)


def test_settings_each_backend_uses_are_accepted():
    external = load_settings(
        engine={"backend": "external", "urls": ["http://gpu-1:30000/"], "model_path": "/m"}
    )
    assert external.engine_urls() == ["http://gpu-1:30000"]  # the gateway's and the trainer's
    assert external.trainer_engine_urls() == ["http://gpu-1:30000"]
    assert policy_engine(external) is None
    attached_teacher = load_settings(
        engine={"backend": "external", "urls": ["http://g:1"], "model_path": "/m"},
        teacher={"enabled": True, "self_teacher": True},
    )
    assert attached_teacher.teacher.self_teacher
    sglang = load_settings(engine={"backend": "sglang", "tp_size": 4, "context_length": 32768})
    assert sglang.engine.tp_size == 4


def test_the_teacher_engine_follows_the_backend(tmp_path):
    s = load_settings(
        engine={"backend": "sglang", "model_path": "/models/student", "weight_version": "5"},
        teacher={"enabled": True, "model_path": "/models/teacher"},
        state_dir=str(tmp_path),
    )
    (engine,) = Stack(s, echo=lambda _: None)._teacher_ports()
    port = s.teacher.engine_port
    cmd = engine.command
    assert engine.name == "teacher-engine" and engine.url.endswith(f":{port}")
    assert cmd[cmd.index("--model-path") + 1] == "/models/teacher"
    assert cmd[cmd.index("--port") + 1] == str(port)
    assert cmd[cmd.index("--served-model-name") + 1] == "teacher"  # the folder's name
    assert cmd[cmd.index("--weight-version") + 1] == "default"  # frozen: not the policy's 5
    embedded = teacher_engine(load_settings(teacher={"enabled": True}), 30100)
    assert embedded.command == [] and embedded.module == "flywheel.engine"


def _extra(extras: dict[str, list[str]], name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Every requirement an extra installs, through its `flywheel[...]` references."""
    out: set[str] = set()
    for req in extras[name]:
        if req.startswith("flywheel["):
            for sub in req[len("flywheel[") : -1].split(","):
                if sub not in seen:
                    out |= _extra(extras, sub, seen | {name})
        else:
            out.add(req)
    return out


def test_the_sglang_extra_pins_the_release_the_protocol_follows_and_stays_out_of_all_and_dev():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["sglang"] == [f"sglang=={SGLANG_RELEASE}"]
    for name in ("all", "dev"):
        assert not any(r.startswith("sglang") for r in _extra(extras, name)), name
    assert f"SGLang {SGLANG_RELEASE}" in (ROOT / "docs" / "engine-protocol.md").read_text()


def test_an_engine_that_exits_is_reported_with_the_tail_of_its_log(tmp_path):
    log_path = tmp_path / "engine.log"
    log_path.write_text("a line of an earlier run\n")
    offset = log_path.stat().st_size
    script = "import sys\nfor i in range(400): print(f'loading shard {i}')\nsys.exit(3)"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=log)
        proc.wait(timeout=60)
    service = Service(
        "engine", "http://127.0.0.1:1", "sglang.launch_server", lambda: False,
        proc=proc, log_path=log_path, log_offset=offset,
    )  # fmt: skip
    report = service.exit_report()
    assert report.startswith(f"engine exited with 3; the end of its log {log_path}:\n")
    assert report.endswith("loading shard 399")
    assert "earlier run" not in report  # only this run's lines
    assert "loading shard 0\n" not in report  # a tail: about 3000 characters


def _sglang_answering(server_args: dict, legacy: bool = False) -> httpx.Client:
    """An HTTP client whose server answers `/server_info` (or only the pre-0.5.12
    `/get_server_info`) with `server_args`, as SGLang reports its arguments."""
    route = "/get_server_info" if legacy else "/server_info"

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == route:
            return httpx.Response(200, json=server_args)
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_an_sglang_server_run_with_arguments_flywheel_cannot_use_is_refused():
    engine = load_settings(
        engine={"backend": "external", "urls": ["http://e:1"], "model_path": "/m"}
    ).engine
    fine = {"context_length": 2048, "grammar_backend": "xgrammar", "tp_size": 8}
    check_server("http://e:1", engine, _sglang_answering(fine))
    check_server("http://e:1", engine, _sglang_answering({"context_length": None}))  # model's
    bad = {
        "context_length": 1024,
        "incremental_streaming_output": True,
        "skip_tokenizer_init": True,
        "grammar_backend": "llguidance",
    }
    with pytest.raises(ConfigurationError) as refused:
        check_server("http://e:1", engine, _sglang_answering(bad, legacy=True))
    message = str(refused.value)
    assert message.startswith("engine http://e:1 cannot serve Flywheel: ")
    assert "its context length is 1024, below engine.context_length = 2048" in message
    assert "without --incremental-streaming-output" in message
    assert "without --skip-tokenizer-init" in message
    assert "its grammar backend is llguidance: run it with --grammar-backend xgrammar" in message


def test_the_demo_reads_the_weight_version_of_an_sglang_older_than_0_5_12(tmp_path):
    from flywheel.ops.demo.runner import DemoConfig, DemoRunner  # noqa: PLC0415

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":  # SGLang 0.5.5 to 0.5.11: no /model_info
            return httpx.Response(200, json={"model_path": "/m", "weight_version": "7"})
        return httpx.Response(404, json={"detail": "Not Found"})

    runner = DemoRunner("http://gateway.invalid", "http://engine.invalid", DemoConfig(), tmp_path)
    runner.http = httpx.Client(transport=httpx.MockTransport(handle))
    assert runner.engine_version() == 7


def test_flywheel_status_probes_the_attached_engine():
    from flywheel.ops.status import service_targets  # noqa: PLC0415

    attached = load_settings(
        engine={"backend": "external", "urls": ["http://gpu-1:30000"], "model_path": "/m"}
    )
    targets = {name: target for name, _, target in service_targets(attached)}
    assert targets["engine"] == "http://gpu-1:30000/health"
    targets = {name: target for name, _, target in service_targets(load_settings())}
    assert targets["engine"] == "http://127.0.0.1:30000/health"
