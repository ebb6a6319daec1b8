"""The compose `cpu` profile built and run for real with podman (`make compose-test`).

The images are built from Debian's archive and PyPI alone (deploy/podman/build-images.sh: a
debootstrap root as BASE_IMAGE, Redis from Debian's package as REDIS_IMAGE), the stack is
started by podman-compose from docker-compose.yml, every service's own compose health check
passes, and the gateway answers an episode's chat request from the openai SDK and records it:
the Sample in the Redis rollouts stream holds the tokens, logprobs and reward of the episode.

Not part of `make test` (it builds images and starts five containers: 10+ minutes on two
cores the first time). It runs when FLYWHEEL_CONTAINER_TESTS=1 (`make compose-test` sets it;
`prebuilt` uses the images already built instead of building them) and skips, saying why,
where podman cannot run containers (not installed, not root, no Debian base image and no
debootstrap). Host set-up, as root: `make podman-setup`.

podman 4.3 (Debian 12) ignores `condition: service_healthy` (podman-compose needs podman 4.6
for it, and runs the services in dependency order only) and, without systemd, runs no health
check by itself: the test runs each check with `podman healthcheck run`, as the health timer
would. The services that start before what they need come up through their restart policy.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from .test_compose import COMPOSE_FILE, ROOT, _active

pytestmark = [
    pytest.mark.containers,
    pytest.mark.skipif(
        not os.environ.get("FLYWHEEL_CONTAINER_TESTS"),
        reason="builds images and runs the compose stack in podman (10+ min): make compose-test",
    ),
]

BASE_TAG = "localhost/flywheel-base:bookworm"
REDIS_IMAGE = "localhost/flywheel-redis:bookworm"
HEALTH_DEADLINE_S = 900.0
READ_SAMPLES = """
import base64, json, sys
from flywheel.core.redis_client import connect
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD
s = load_settings()
rows = connect(s.redis_url()).xrange(s.streams.key(sys.argv[1]))
print(json.dumps([base64.b64encode(f[FIELD]).decode() for _, f in rows]))
"""
PROFILES = [("cpu",), ("cpu", "teacher")]
HEALTH_CHECKED = {
    ("cpu",): {"redis", "engine", "gateway", "trainer", "reward"},
    ("cpu", "teacher"): {
        "redis",
        "engine",
        "gateway",
        "trainer",
        "reward",
        "teacher-engine",
        "teacher",
    },
}


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _podman_or_skip() -> str:
    """podman, or a skip naming what is missing."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed: as root, `make podman-setup` (Debian packages)")
    info = _run([podman, "info", "--format", "{{.Host.OCIRuntime.Name}}"], 120)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here: {info.stderr.strip()[-300:]}")
    have_base = _run([podman, "image", "exists", BASE_TAG], 60).returncode == 0
    if not have_base and os.geteuid() != 0:
        pytest.skip(f"no {BASE_TAG} and not root: debootstrap needs root (make podman-setup)")
    if not have_base and shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed: as root, `make podman-setup`")
    return podman


@pytest.fixture(scope="module")
def images() -> str:
    """Every image of the cpu profile, built (podman's layer cache makes a rebuild quick)."""
    podman = _podman_or_skip()
    if os.environ.get("FLYWHEEL_CONTAINER_TESTS") != "prebuilt":
        build = _run([str(ROOT / "deploy/podman/build-images.sh")], 5400, cwd=ROOT)
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    probe = _run([podman, "run", "--rm", BASE_TAG, "python3", "-c", "print(40 + 2)"], 300)
    if probe.returncode != 0:  # built, but this host cannot start a container
        pytest.skip(f"podman cannot start a container here: {probe.stderr.strip()[-400:]}")
    assert probe.stdout.strip() == "42"
    return podman


@dataclass
class ComposeStack:
    podman: str
    project: str
    env: dict[str, str]
    port: int
    profiles: tuple[str, ...]

    def containers(self) -> dict[str, str]:
        """compose service -> container name."""
        out = _run(
            [
                self.podman,
                "ps",
                "-a",
                "--filter",
                f"label=io.podman.compose.project={self.project}",
                "--format",
                "json",
            ],
            60,
        )
        rows = json.loads(out.stdout or "[]")
        return {r["Labels"]["com.docker.compose.service"]: r["Names"][0] for r in rows}

    def exec(self, service: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return _run([self.podman, "exec", self.containers()[service], *cmd], timeout)

    def logs(self) -> str:
        tails = []
        for service, name in sorted(self.containers().items()):
            out = _run([self.podman, "logs", "--tail", "25", name], 60)
            tails.append(f"--- {service}\n{out.stdout[-2500:]}{out.stderr[-2500:]}")
        return "\n".join(tails)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=PROFILES, ids=lambda p: "+".join(p))
def stack(request, images: str, tmp_path_factory) -> Iterator[ComposeStack]:
    """The stack of one profile set, started (`cpu`; `cpu,teacher` with the teacher on), then
    removed with its volumes."""
    profiles = request.param
    project = f"flywheel-ct{os.getpid()}-{len(profiles)}"
    port = _free_port()
    env = {
        "PATH": f"{ROOT / '.venv/bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path_factory.mktemp("compose_home")),
        "COMPOSE_PROFILES": ",".join(profiles),
        "FLYWHEEL_TEACHER_ENABLED": "true" if "teacher" in profiles else "false",
        "REDIS_PASSWORD": secrets.token_hex(16),
        "REDIS_IMAGE": REDIS_IMAGE,
        "GATEWAY_PORT": str(port),
        "FLYWHEEL_TAG": "dev",
    }
    compose = [shutil.which("podman-compose", path=env["PATH"]) or "podman-compose"]
    base = [*compose, "-p", project, "-f", str(COMPOSE_FILE)]
    running = ComposeStack(images, project, env, port, profiles)
    try:
        up = _run([*base, "up", "-d", "--no-build"], 1200, env=env, cwd=ROOT)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield running
    finally:
        down = _run([*base, "down", "-v", "-t", "10"], 600, env=env, cwd=ROOT)
        if down.returncode != 0:
            print(down.stdout[-2000:], down.stderr[-2000:])


def test_every_service_passes_its_compose_health_check(stack):
    """Each long-running service of the profile is up and its own health check (the compose
    `healthcheck.test`, run in the container) passes; model-init ran to completion. With the
    teacher, that means it started: its vocabulary check passed against the model the teacher
    engine serves and the student's (the CPU engine's) tokenizer."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    active = _active(compose, stack.profiles)
    waiting = {n for n, s in active.items() if "healthcheck" in s}
    assert waiting == HEALTH_CHECKED[stack.profiles]
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    last: dict[str, str] = {}
    while waiting and time.monotonic() < deadline:
        names = stack.containers()
        for service in sorted(waiting):
            if service not in names:
                last[service] = "no container"
                continue
            check = _run([stack.podman, "healthcheck", "run", names[service]], 120)
            last[service] = (check.stdout + check.stderr).strip()[-300:]
            if check.returncode == 0:
                waiting.discard(service)
        if waiting:
            time.sleep(10)
    assert not waiting, f"unhealthy after {HEALTH_DEADLINE_S} s: {last}\n{stack.logs()}"
    init = _run(
        [
            stack.podman,
            "inspect",
            "--format",
            "{{.State.Status}} {{.State.ExitCode}}",
            stack.containers()["model-init"],
        ],
        60,
    )
    assert init.stdout.split() == ["exited", "0"], init.stdout + init.stderr


def _samples(stack: ComposeStack, stream: str, session_id: str, wait_s: float) -> list:
    """The Samples of one session in a stream (read inside the network by the gateway image),
    waiting up to `wait_s` for the first."""
    from flywheel.core.codec import decode_sample  # noqa: PLC0415

    deadline = time.monotonic() + wait_s
    while True:
        read = stack.exec("gateway", "python", "-c", READ_SAMPLES, stream)
        assert read.returncode == 0, read.stdout + read.stderr
        found = [decode_sample(base64.b64decode(b)) for b in json.loads(read.stdout)]
        found = [s for s in found if s.session_id == session_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(3)


def test_the_stack_answers_a_chat_request_and_records_it(stack, smollm2_dir):
    """An API key minted inside the network, an episode (session, chat completion, finish)
    through the published gateway port with the openai SDK, and its Sample in the rollouts
    stream: the sampled tokens, their logprobs and the reward are the ones served and posted.
    Downstream, the reward service (and with the teacher profile, the teacher) passes it on to
    the train stream; the teacher scores exactly the sampled tokens."""
    import httpx  # noqa: PLC0415
    from openai import OpenAI  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    test_every_service_passes_its_compose_health_check(stack)
    minted = stack.exec("gateway", "flywheel", "keys", "create", "--role", "agent", "--name", "ct")
    assert minted.returncode == 0, minted.stdout + minted.stderr
    key = minted.stdout.strip().splitlines()[-1]
    gateway = f"http://127.0.0.1:{stack.port}"
    auth = {"Authorization": f"Bearer {key}"}
    refused = httpx.post(f"{gateway}/v1/sessions", json={}, timeout=60)
    assert refused.status_code == 401, refused.text  # 0.0.0.0 in a container: keys required
    task = {"hint": "Greet the container test warmly in one sentence."}
    session = httpx.post(
        f"{gateway}/v1/sessions", json={"task": task}, headers=auth, timeout=60
    ).json()
    client = OpenAI(base_url=session["base_url"], api_key=key, timeout=300)
    model = client.models.list().data[0].id
    prompt = f"Say hello to container test {secrets.token_hex(3)}."
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0.0,
        logprobs=True,
    )
    text = reply.choices[0].message.content or ""
    assert text.strip() and reply.usage is not None
    finished = httpx.post(
        f"{gateway}/v1/sessions/{session['session_id']}/finish",
        json={"reward": 0.75},
        headers=auth,
        timeout=120,
    )
    assert finished.status_code == 200 and finished.json()["samples_published"] == 1, finished.text
    samples = _samples(stack, "rollouts", session["session_id"], 0)
    assert len(samples) == 1, f"the rollouts stream lacks the episode\n{stack.logs()}"
    (sample,) = samples
    n = sample.prompt_length
    sampled = list(sample.token_ids[n:])
    rows = reply.choices[0].logprobs.content or []
    # the reply's tokens exactly as sampled: loss mask over them only, as many as the usage and
    # the logprob rows count, the same logprobs, decoding to the reply
    assert list(sample.loss_mask) == [0] * n + [1] * len(sampled)
    assert len(sampled) == reply.usage.completion_tokens == len(rows)
    assert list(sample.rollout_logprobs[n:]) == pytest.approx([r.logprob for r in rows], abs=1e-6)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.decode(sampled, skip_special_tokens=True).strip() == text.strip()
    assert prompt in tok.decode(sample.token_ids[:n])
    assert sample.rewards["outcome"] == 0.75

    trained = _samples(stack, "train", session["session_id"], 300)
    assert len(trained) == 1, f"the train stream lacks the episode\n{stack.logs()}"
    (scored,) = trained
    assert list(scored.token_ids) == list(sample.token_ids) and scored.has_reward
    if "teacher" in stack.profiles:
        # teacher logprobs over exactly the sampled tokens, from the frozen SmolLM2 engine
        assert scored.teacher_status == "scored", scored.teacher_status
        assert list(scored.teacher_mask) == list(sample.loss_mask)
        lps = [lp for lp, m in zip(scored.teacher_logprobs, scored.teacher_mask, strict=True) if m]
        assert len(lps) == len(sampled) and all(lp <= 0.0 for lp in lps)
        assert scored.teacher_model == "SmolLM2-135M-Instruct"
    else:
        assert scored.teacher_status == "" and not scored.teacher_logprobs
