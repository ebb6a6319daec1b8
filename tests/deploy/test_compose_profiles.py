"""Every combination of compose profiles, offline.

The profiles (cpu, gpu, teacher, teacher-gpu, observability) give 2^5 = 32 combinations. Each
one is either supported (a complete, health-gated graph with one provider per network name and
settings that parse), refused by compose (a service depends on one its profiles leave out; the
compose spec makes that an error), refused at start (two services publish the same host port),
or serves nothing (no gateway, so nothing records a Sample). No combination starts a stack that
runs with the wrong settings, which is what `gpu,teacher` did: its teacher believed the student
was SmolLM2 while the policy engine served Qwen3, so the vocabulary guard compared the wrong
model.

Each supported set is also rendered by podman-compose's `config` (it applies profiles and
interpolation, which Debian's docker-compose v1 does not filter) and checked against the
compose-spec schema.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flywheel.core.paths import resolve_model_path
from flywheel.teacher.main import load_tokenizers
from flywheel.teacher.vocab import VocabularyMismatchError

from .test_compose import (
    COMPOSE_FILE,
    REQUIRED_ENV,
    ROOT,
    _active,
    _interpolate,
    _names,
    _settings,
)

SUPPORTED = [
    ("cpu",),
    ("gpu",),
    ("cpu", "teacher"),
    ("gpu", "teacher-gpu"),
    ("cpu", "observability"),
    ("gpu", "observability"),
    ("cpu", "teacher", "observability"),
    ("gpu", "teacher-gpu", "observability"),
]
NETWORK_NAMES = ("redis", "engine", "gateway", "trainer", "reward")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _profiles(compose: dict) -> list[str]:
    return sorted({p for svc in compose["services"].values() for p in svc.get("profiles", [])})


def _combinations(compose: dict) -> list[tuple[str, ...]]:
    names = _profiles(compose)
    return [c for n in range(len(names) + 1) for c in itertools.combinations(names, n)]


def _disabled_dependencies(active: dict[str, dict]) -> list[tuple[str, str]]:
    """(service, dependency) pairs whose dependency the profiles leave out: compose refuses
    such a model ("service X depends on Y, which is disabled")."""
    return [(n, d) for n, s in active.items() for d in s.get("depends_on") or {} if d not in active]


def _published_host_ports(active: dict[str, dict]) -> list[str]:
    ports = []
    for svc in active.values():
        for spec in svc.get("ports", []):
            host = _interpolate(str(spec), REQUIRED_ENV).rsplit(":", 1)[0]
            ports.append(host)
    return ports


def _graph_problems(active: dict[str, dict], profiles: tuple[str, ...]) -> list[str]:
    problems = []
    names = [n for name, svc in active.items() for n in _names(name, svc)]
    for needed in NETWORK_NAMES:
        if names.count(needed) != 1:
            problems.append(f"{names.count(needed)} services answer {needed!r}")
    if {"teacher", "teacher-gpu"} & set(profiles):
        for needed in ("teacher", "teacher-engine"):
            if names.count(needed) != 1:
                problems.append(f"{names.count(needed)} services answer {needed!r}")
    return problems


def test_there_are_32_combinations_and_each_is_supported_or_refused(compose):
    assert _profiles(compose) == ["cpu", "gpu", "observability", "teacher", "teacher-gpu"]
    combos = _combinations(compose)
    assert len(combos) == 2**5
    outcome = {}
    for profiles in combos:
        active = _active(compose, profiles)
        refused = _disabled_dependencies(active)
        ports = _published_host_ports(active)
        clash = len(ports) != len(set(ports))
        if tuple(sorted(profiles)) in {tuple(sorted(s)) for s in SUPPORTED}:
            assert not refused and not clash, (profiles, refused, ports)
            assert _graph_problems(active, profiles) == [], profiles
            outcome[profiles] = "supported"
        elif refused:
            outcome[profiles] = "refused"
        elif clash:
            outcome[profiles] = "port clash"
        else:
            # Neither policy profile: Redis and reward (+ Prometheus, Grafana) only.
            assert not {"cpu", "gpu"} & set(profiles), profiles
            assert not any("gateway" in _names(n, s) for n, s in active.items()), profiles
            outcome[profiles] = "serves nothing"
    counts = {k: list(outcome.values()).count(k) for k in set(outcome.values())}
    assert counts["supported"] == len(SUPPORTED) == 8
    assert outcome[("gpu", "teacher")] == "refused"
    assert outcome[("cpu", "teacher-gpu")] == "refused"
    assert outcome[("teacher",)] == "refused"
    assert outcome[("cpu", "gpu")] == "port clash"
    assert outcome[()] == outcome[("observability",)] == "serves nothing"
    assert sum(counts.values()) == 32


@pytest.mark.parametrize(
    ("profiles", "teacher", "missing"),
    [(("gpu", "teacher"), "teacher", "engine"), (("cpu", "teacher-gpu"), "teacher-gpu", "sglang")],
    ids=["gpu+teacher", "cpu+teacher-gpu"],
)
def test_a_teacher_is_refused_beside_the_other_profiles_policy(compose, profiles, teacher, missing):
    """The CPU teacher depends on the CPU policy engine and the GPU teacher on SGLang, so a
    teacher whose settings describe another student never starts."""
    active = _active(compose, profiles)
    assert (teacher, missing) in _disabled_dependencies(active)


def test_gpu_teacher_is_told_the_policy_model(compose, monkeypatch):
    active = _active(compose, ("gpu", "teacher-gpu"))
    policy = [str(a) for a in active["sglang"]["command"]]
    teacher_engine = [str(a) for a in active["sglang-teacher"]["command"]]

    def model(cmd: list[str]) -> str:
        return _interpolate(cmd[cmd.index("--model-path") + 1], REQUIRED_ENV)

    settings = _settings(active["teacher-gpu"], monkeypatch)
    ts = settings.teacher
    assert ts.student_tokenizer_path == settings.gateway.tokenizer_path == model(policy)
    assert settings.engine.model_path == model(policy)
    assert ts.tokenizer_path == ts.model_path == model(teacher_engine)
    assert ts.engine_urls == ["http://teacher-engine:30000"]
    assert "teacher-engine" in _names("sglang-teacher", active["sglang-teacher"])
    # the teacher reads both tokenizers from the volume SGLang downloads them into, offline
    env = {
        k: _interpolate(str(v), REQUIRED_ENV)
        for k, v in active["teacher-gpu"]["environment"].items()
    }
    assert env["HF_HOME"] == "/hf" and env["HF_HUB_OFFLINE"] == "1"
    assert any(v.split(":")[:2] == ["hf-cache", "/hf"] for v in active["teacher-gpu"]["volumes"])
    assert any(v.split(":")[:2] == ["hf-cache", "/hf"] for v in active["sglang-teacher"]["volumes"])
    # the CPU teacher names the model the CPU engine serves
    cpu = _active(compose, ("cpu", "teacher"))
    cpu_settings = _settings(cpu["teacher"], monkeypatch)
    assert (
        cpu_settings.teacher.student_tokenizer_path
        == _settings(cpu["engine"], monkeypatch).engine.model_path
    )


def _teacher_start_check(service: dict, env: dict[str, str], monkeypatch) -> None:
    """What flywheel.teacher.main does with its settings before serving: the vocabulary check
    between the student's tokenizer and the teacher's."""
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        if key.startswith("FLYWHEEL_") and key != "FLYWHEEL_CACHE":
            monkeypatch.setenv(key, _interpolate(str(value), env))
    from flywheel.core.settings import load_settings  # noqa: PLC0415

    settings = load_settings()
    engine_model = resolve_model_path(settings.engine.model_path)
    ts = settings.teacher
    teacher_model = Path(ts.model_path) if ts.model_path else engine_model
    load_tokenizers(settings, teacher_model, engine_model)


def test_gpu_teacher_vocabulary_guard_compares_the_policy_model(
    compose, smollm2_dir, tmp_path, monkeypatch
):
    """The GPU teacher's settings from compose, with the two models pointed at real tokenizer
    folders: a teacher of another vocabulary than FLYWHEEL_MODEL's is refused at start; the
    same family passes."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    other.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    other.save_pretrained(tmp_path / "other")
    teacher = compose["services"]["teacher-gpu"]
    smol = str(smollm2_dir)
    same = {**REQUIRED_ENV, "FLYWHEEL_MODEL": smol, "FLYWHEEL_TEACHER_MODEL": smol}
    _teacher_start_check(teacher, same, monkeypatch)
    foreign = {**same, "FLYWHEEL_MODEL": str(tmp_path / "other")}
    with pytest.raises(VocabularyMismatchError, match="differs from the student"):
        _teacher_start_check(teacher, foreign, monkeypatch)


def _podman_compose() -> str:
    exe = shutil.which("podman-compose", path=f"{ROOT / '.venv/bin'}:{os.environ['PATH']}")
    if exe is None:
        pytest.fail("podman-compose is missing: `make setup` installs it (dev extra)")
    return exe


@pytest.mark.parametrize("profiles", SUPPORTED, ids=lambda p: "+".join(p))
def test_podman_compose_config_renders_each_supported_profile_set(compose, profiles, tmp_path):
    """podman-compose applies COMPOSE_PROFILES and interpolation (no engine needed); the
    rendered file has exactly the active services and passes the compose-spec schema."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "COMPOSE_PROFILES": ",".join(profiles),
        **REQUIRED_ENV,
    }
    run = subprocess.run(
        [_podman_compose(), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rendered = yaml.safe_load(run.stdout)
    assert set(rendered["services"]) == set(_active(compose, profiles))
    assert "${" not in run.stdout
    out = tmp_path / "rendered.yml"
    out.write_text(run.stdout)
    exe = shutil.which("check-jsonschema") or str(ROOT / ".venv/bin/check-jsonschema")
    schema = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert schema.returncode == 0, schema.stdout + schema.stderr
