"""Demo runner: rollouts through the gateway, training by the trainer, evaluation before/after.

Each step: P training problems x G samples. For every sample the environment creates a session
(`group_id` = the problem's group, task = its answer), the agent answers through the session's
base_url with the OpenAI SDK, and the environment finishes the session; the gateway publishes
the Sample, the reward service scores it, the trainer steps once per P groups and pushes the new
weights. The runner waits for the engine to serve that weight version, then starts the next step
(synchronous, on-policy). Evaluation sessions are marked `eval` and never become training data.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from flywheel.core.answers import last_integer
from flywheel.core.versions import parse_weight_version
from flywheel.ops.demo.agent import answer
from flywheel.ops.demo.plot import plot_rewards
from flywheel.ops.demo.tasks import Problem, split, training_batches


@dataclass
class DemoConfig:
    steps: int = 30
    problems_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    step_timeout_s: float = 600.0
    model: str = "SmolLM2-135M-Instruct"


class DemoRunner:
    """Drives a running stack. URLs are the gateway's and the engine's base URLs."""

    def __init__(
        self,
        gateway_url: str,
        engine_url: str,
        cfg: DemoConfig,
        out: Path,
        echo: Callable[[str], None] = print,
    ):
        self.gateway = gateway_url.rstrip("/")
        self.engine = engine_url.rstrip("/")
        self.cfg = cfg
        self.out = out
        self.echo = echo
        self.http = httpx.Client(timeout=600)
        self.pool = ThreadPoolExecutor(max_workers=cfg.problems_per_step * cfg.group_size)

    def episode(
        self, problem: Problem, group_id: str, *, evaluation: bool, temperature: float
    ) -> float:
        """One session: create, let the agent answer, finish. Returns the verifier reward."""
        created = self.http.post(
            f"{self.gateway}/v1/sessions",
            json={"group_id": group_id, "task": problem.task, "eval": evaluation},
        ).raise_for_status()
        session = created.json()
        reply = answer(
            session["base_url"],
            problem.question,
            model=self.cfg.model,
            temperature=temperature,
            max_tokens=self.cfg.max_tokens,
        )
        self.http.post(
            f"{self.gateway}/v1/sessions/{session['session_id']}/finish", json={}
        ).raise_for_status()
        return last_integer(reply, problem.task)

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out problems (evaluation sessions)."""
        _, held_out = split()
        self.echo(f"evaluating {len(held_out)} held-out problems (greedy)...")
        rewards = list(
            self.pool.map(lambda p: self.episode(p, "", evaluation=True, temperature=0.0), held_out)
        )
        return sum(rewards) / len(rewards)

    def rollouts(self, problems: list[Problem]) -> list[float]:
        jobs = []
        for problem in problems:
            group_id = f"g-{uuid.uuid4().hex[:12]}"
            jobs += [(problem, group_id)] * self.cfg.group_size
        return list(
            self.pool.map(
                lambda job: self.episode(
                    job[0], job[1], evaluation=False, temperature=self.cfg.temperature
                ),
                jobs,
            )
        )

    def engine_version(self) -> int:
        return parse_weight_version(
            self.http.get(f"{self.engine}/model_info").json().get("weight_version")
        )

    def wait_for_version(self, version: int) -> None:
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while self.engine_version() < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine did not reach weight version {version} within "
                    f"{self.cfg.step_timeout_s}s: is the trainer running with groups_per_step="
                    f"{self.cfg.problems_per_step} and group_size={self.cfg.group_size}? "
                    "See its log."
                )
            time.sleep(0.2)

    def run(self, started_at: float | None = None) -> dict[str, float]:
        """Run the whole demo; writes metrics.jsonl and reward_curve.png into `out`.

        Args:
            started_at: `time.monotonic()` when the demo command began (stack start-up
                included in `minutes`); None = now.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic() if started_at is None else started_at
        eval_before = self.evaluate()
        version0 = self.engine_version()
        self.echo(
            f"eval before training: held-out greedy accuracy {eval_before:.3f} "
            f"(weight version {version0})"
        )
        batches = training_batches(self.cfg.seed, self.cfg.problems_per_step)
        steps, rewards = [], []
        metrics_path = self.out / "metrics.jsonl"
        with metrics_path.open("w") as f:
            for step in range(1, self.cfg.steps + 1):
                start = time.monotonic()
                step_rewards = self.rollouts(next(batches))
                self.wait_for_version(version0 + step)
                mean = sum(step_rewards) / len(step_rewards)
                steps.append(step)
                rewards.append(mean)
                seconds = time.monotonic() - start
                row = {
                    "step": step,
                    "reward_mean": mean,
                    "weight_version": version0 + step,
                    "seconds": round(seconds, 2),
                    "samples": len(step_rewards),
                }
                f.write(json.dumps(row) + "\n")
                f.flush()
                self.echo(
                    f"step {step:3d}  reward {mean:.3f}  weight_version "
                    f"{version0 + step}  {seconds:.1f}s"
                )
        eval_after = self.evaluate()
        minutes = (time.monotonic() - t0) / 60
        plot_rewards(
            steps, rewards, {0: eval_before, len(steps): eval_after}, self.out / "reward_curve.png"
        )
        first5 = sum(rewards[:5]) / max(len(rewards[:5]), 1)
        last5 = sum(rewards[-5:]) / max(len(rewards[-5:]), 1)
        summary = {
            "first5": first5,
            "last5": last5,
            "eval_before": eval_before,
            "eval_after": eval_after,
            "steps": len(steps),
            "minutes": minutes,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.echo(
            f"reward first5={first5:.3f} last5={last5:.3f} eval_before={eval_before:.3f} "
            f"eval_after={eval_after:.3f} steps={len(steps)} minutes={minutes:.1f}"
        )
        return summary
