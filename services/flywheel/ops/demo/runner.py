"""Demo runner: rollouts through the gateway, training by the trainer, evaluation before/after.

Each step: P training problems x G samples. For every sample the environment creates a session
(`group_id` = the problem's group, task = its answer), the agent answers through the session's
base_url with the OpenAI SDK, and the environment finishes the session; the gateway publishes
the Sample, the reward service scores it, the trainer steps once per P groups and pushes the new
weights (version k = trained on steps 1..k).

Pacing (`may_start`): rollouts of step s begin once the engine serves weight version
s - 1 - max_staleness (counted from the version it served when the run began). In "async" mode
(the default) rollouts never wait for training beyond that: with max_staleness 1, step 2's
rollouts begin right after step 1's, on the initial weights, while the trainer trains on step 1.
"sync" mode is max_staleness 0: step s waits for version s - 1 (on-policy). After the last step
the runner waits for the final version before the held-out evaluation. Evaluation sessions are
marked `eval` and never become training data.

Writes `metrics.jsonl` (a row per step), `demo_timeline.jsonl` (its rollout and eval spans),
`reward_curve.png`, `timeline.png` (with the trainer's `timeline.jsonl` spans) and
`summary.json`.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import openai

from flywheel.core.answers import last_integer
from flywheel.core.versions import parse_weight_version
from flywheel.ops.demo.agent import answer
from flywheel.ops.demo.cancel import request_check
from flywheel.ops.demo.failures import access_refusal, describe_failure
from flywheel.ops.demo.plot import (
    TimelineEvent,
    plot_rewards,
    plot_timeline,
    read_timeline_lines,
)
from flywheel.ops.demo.pool import EpisodePool
from flywheel.ops.demo.tasks import Problem, split, training_batches

P = TypeVar("P")
R = TypeVar("R")
REWARD_WINDOW = 5
"""Steps in each of summary.json's reward windows (`first5`, `last5`): given from 10 steps."""


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
    mode: Literal["async", "sync"] = "async"
    """async: rollouts run up to `max_staleness` steps ahead of the served weights; sync: each
    step waits for the previous step's weights (max_staleness 0)."""
    max_staleness: int = 1
    """Steps the rollouts may run ahead of the engine's weight version (async mode)."""
    poll_s: float = 0.2
    """Seconds between the runner's checks of the engine's weight version."""


def min_version_to_start(step: int, max_staleness: int) -> int:
    """The weight version (counted from the run's first, 0) the engine must serve before
    rollouts of `step` (1-based) begin: step - 1 - max_staleness."""
    return step - 1 - max_staleness


def may_start(step: int, version: int, max_staleness: int) -> bool:
    """Whether rollouts of `step` may begin while the engine serves `version` (counted from the
    run's first, 0).

    Examples, max_staleness 1: step 1 and step 2 start at version 0, step 3 needs version 1,
    step 4 version 2. max_staleness 0 (sync): step s needs version s - 1.
    """
    return version >= min_version_to_start(step, max_staleness)


class StepFailed(RuntimeError):
    """Every episode of a step failed: no Sample reached the trainer, so the weight version the
    run waits for cannot come. The message says how many, the first error and where the logs
    are."""

    def __init__(self, step: int, episodes: int, first_error: str, logs: Path | None):
        where = f"; the stack's logs are in {logs}" if logs is not None else ""
        super().__init__(
            f"all {episodes} episodes of step {step} failed, so no sample reached the trainer "
            f"and no new weight version can come; the demo stops instead of waiting. First: "
            f"episode {first_error}{where}"
        )
        self.step = step


class DemoRunner:
    """Drives a running stack. URLs are the gateway's and the engine's base URLs."""

    def __init__(
        self,
        gateway_url: str,
        engine_url: str,
        cfg: DemoConfig,
        out: Path,
        echo: Callable[[str], None] | None = None,
        trainer_timeline: Path | None = None,
        api_key: str | None = None,
        logs: Path | None = None,
        config_file: str | None = None,
    ):
        """`trainer_timeline`: the trainer's `timeline.jsonl` (in its metrics file's folder);
        None = `out/timeline.jsonl`. Drawn into timeline.png when present. `api_key`: the key
        the runner's session requests and every agent send (None: none, for a gateway that
        requires no key). `logs`: the stack's log folder, named when a step fails.
        `config_file`: the demo's `--config` file, repeated in the commands its API key hints
        print."""
        self.logs = logs
        self.config_file = config_file
        self.gateway = gateway_url.rstrip("/")
        self.engine = engine_url.rstrip("/")
        self.cfg = cfg
        self.out = out
        self.echo = echo or echo_line
        self.trainer_timeline = trainer_timeline or out / "timeline.jsonl"
        self.timeline_origin: float | None = None
        """The demo's start in unix seconds, once `run` began."""
        self.timeline: list[TimelineEvent] = []
        """The demo's own spans of this run (also in `out/demo_timeline.jsonl`)."""
        self.api_key = api_key
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stopping = threading.Event()
        """Set once the run is interrupted: every episode's next request raises
        `EpisodeCancelled` (`cancel.py`) and its failures are no longer logged."""
        self.in_flight = 0
        """Episodes begun and not yet ended."""
        hooks = {"request": [request_check(self.stopping)]}
        self.http = httpx.Client(timeout=600, headers=auth, event_hooks=hooks)
        self.pool = EpisodePool(max_workers=cfg.problems_per_step * cfg.group_size)
        """Its workers never hold the process's exit (`pool.py`)."""
        self.lock = threading.Lock()
        self.failed = 0
        """Episodes of the current step the gateway failed (scored 0; `failed_episodes`)."""
        self.first_error = ""
        """The first failed episode of the current step, as logged."""
        self.steps: list[int] = []
        self.rewards: list[float] = []
        """The steps whose rollouts ended and their mean training reward."""
        self.eval_points: dict[int, float] = {}
        """Held-out accuracy by the step it followed (0 = before training); an evaluation whose
        every episode failed measured nothing and has none."""
        self.episodes_run = 0
        """Episodes `in_pool` ran (begun) in this run, training and evaluation."""
        self.interrupted: dict[str, object] | None = None
        """The summary `write_interrupted` wrote when the run was interrupted."""

    def episode(
        self, problem: Problem, group_id: str, *, evaluation: bool, temperature: float
    ) -> float:
        """One session: create, let the agent answer, finish. Returns the verifier reward.

        An episode the gateway still fails after the client's retries (a 5xx such as 502 "no
        engine could serve the request", or a timeout) is finished with reward 0, counted in
        the step's `failed_episodes` and logged; it never ends the run.
        """
        session: dict[str, Any] | None = None
        try:
            session = self.open_session(group_id, problem.task, evaluation=evaluation)
            reply = answer(
                session["base_url"],
                problem.question,
                model=self.cfg.model,
                temperature=temperature,
                max_tokens=self.cfg.max_tokens,
                api_key=self.agent_key,
                stopping=self.stopping,
            )
            self.finish_session(session["session_id"], {})
        except (openai.APIError, httpx.HTTPError) as exc:
            self._failed_episode(session, exc)
            return 0.0
        return last_integer(reply, problem.task)

    def _failed_episode(self, session: dict[str, Any] | None, exc: Exception) -> None:
        """Count and log an episode the gateway failed or refused (`describe_failure`: a 401 or
        403 is the demo's key, not the server); finish its session with reward 0. Once the run
        is stopping it says nothing: the demo's own shutdown is no episode's failure."""
        if self.stopping.is_set():
            return
        with self.lock:
            self.failed += 1
        sid = session["session_id"] if session else "(not created)"
        said = f"{sid} {describe_failure(exc, self.config_file)}"
        with self.lock:
            self.first_error = self.first_error or said
        self.echo(f"episode {said}")
        if session is not None:
            try:
                self.finish_session(sid, {"reward": 0.0})
            except httpx.HTTPError as finish_exc:
                self.echo(f"episode {sid}: finishing it failed too: {finish_exc}")

    @property
    def agent_key(self) -> str:
        """The API key the agents' OpenAI clients send: the demo's, else a placeholder (the SDK
        needs one; a gateway that requires no key ignores it)."""
        return self.api_key or "flywheel-local"

    def access_refusal(self) -> str | None:
        """Why the gateway will refuse this demo's requests (401/403 to its key, or to no key;
        404 to its model), as the CLI says it before the first step; None when it serves them."""
        return access_refusal(
            self.http, self.gateway, self.api_key, self.config_file, model=self.cfg.model
        )

    def evaluate(self) -> float | None:
        """Greedy accuracy on the held-out problems (evaluation sessions); a subclass returns
        None for one that measured nothing (and says why)."""
        _, held_out = split()
        self.echo(f"evaluating {len(held_out)} held-out problems (greedy)...")
        rewards = self.in_pool(
            lambda p: self.episode(p, "", evaluation=True, temperature=0.0), held_out
        )
        return sum(rewards) / len(rewards)

    def rollouts(self, problems: list[Problem]) -> list[float]:
        """The step's training episodes (`run_groups`); returns their rewards."""
        return self.run_groups(
            problems,
            lambda problem, group_id: self.episode(
                problem, group_id, evaluation=False, temperature=self.cfg.temperature
            ),
        )

    def run_groups(self, problems: list[P], episode: Callable[[P, str], R]) -> list[R]:
        """`episode(problem, group_id)` `group_size` times per problem, all of a problem under
        one new group id, run in the pool; returns the results in that order. Starts the step's
        `failed` count at 0."""
        self.failed, self.first_error = 0, ""
        jobs: list[tuple[P, str]] = []
        for problem in problems:
            group_id = f"g-{uuid.uuid4().hex[:12]}"
            jobs += [(problem, group_id)] * self.cfg.group_size
        return self.in_pool(lambda job: episode(*job), jobs)

    def in_pool(self, fn: Callable[[P], R], items: list[P]) -> list[R]:
        """`fn` of each item, run in the pool; the results in order. Then a full garbage
        collection: each episode's `OpenAI` client (its httpx client, SSL context, connection
        pool) ends in reference cycles that only the cyclic collector frees, and its rare
        full passes let them pile up (the driver grew by about 5 MiB per 32 episodes, to 0.33
        GiB over a 45-step run); collected after every batch it stays near 0.11 GiB."""

        def tracked(item: P) -> R:
            with self.lock:
                self.in_flight += 1
            try:
                return fn(item)
            finally:
                with self.lock:
                    self.in_flight -= 1

        self.episodes_run += len(items)
        results = list(self.pool.map(tracked, items))
        gc.collect()
        return results

    def open_session(
        self, group_id: str, task: dict[str, Any], *, evaluation: bool
    ) -> dict[str, Any]:
        """Create a gateway session of `group_id` for `task` (`eval` = `evaluation`); returns
        the gateway's reply (`session_id`, `base_url`).

        Raises:
            httpx.HTTPError: the gateway refused or could not be reached.
        """
        created = self.http.post(
            f"{self.gateway}/v1/sessions",
            json={"group_id": group_id, "task": task, "eval": evaluation},
        ).raise_for_status()
        return created.json()

    def finish_session(self, session_id: str, body: dict[str, Any]) -> None:
        """Finish a session with `body` (`{"reward": r}`, or `{}` to leave it to the verifier).

        Raises:
            httpx.HTTPError: the gateway refused or could not be reached.
        """
        self.http.post(
            f"{self.gateway}/v1/sessions/{session_id}/finish", json=body
        ).raise_for_status()

    def engine_version(self) -> int:
        """The weight version the engine serves: `/model_info`, or `/get_model_info` on an SGLang
        server older than 0.5.12 (404 on the new route)."""
        for path in ("/model_info", "/get_model_info"):
            reply = self.http.get(f"{self.engine}{path}")
            if reply.status_code != 404:
                break
        return parse_weight_version(reply.json().get("weight_version"))

    @property
    def staleness(self) -> int:
        """Steps the rollouts may run ahead of the served weights: 0 in sync mode."""
        return 0 if self.cfg.mode == "sync" else self.cfg.max_staleness

    def wait_for_version(self, version: int, timeout_s: float | None = None) -> int:
        """Poll the engine until it serves `version` or newer; returns the version it serves."""
        timeout_s = self.cfg.step_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while (served := self.engine_version()) < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine did not reach weight version {version} within "
                    f"{timeout_s}s: is the trainer running with groups_per_step="
                    f"{self.cfg.problems_per_step} and group_size={self.cfg.group_size}? "
                    "See its log."
                )
            time.sleep(self.cfg.poll_s)
        return served

    def wait_to_start(self, step: int, version0: int) -> int:
        """Block until rollouts of `step` may begin (`may_start`); returns the served version."""
        return self.wait_for_version(version0 + min_version_to_start(step, self.staleness))

    def _record(self, stage: str, step: int, start: float, end: float) -> None:
        event = TimelineEvent("demo", stage, step, start, end)
        self.timeline.append(event)
        with (self.out / "demo_timeline.jsonl").open("a") as f:
            f.write(event.to_json() + "\n")

    def _timed_evaluate(self, step: int) -> float | None:
        """`evaluate`, recorded in the timeline and in `eval_points`; None (and no point) when
        every episode of it failed, or `evaluate` gave None: that measured nothing, and 0.0
        would read as a result."""
        start = time.time()
        self.failed, begun = 0, self.episodes_run
        accuracy = self.evaluate()
        self._record("eval", step, start, time.time())
        if self.failed >= self.episodes_run - begun:
            self.echo(f"evaluation not measured: all {self.failed} held-out episodes failed")
            return None
        if accuracy is None:  # its draw measured nothing; `evaluate` said why
            return None
        self.eval_points[step] = accuracy
        return accuracy

    def draw_timeline(self) -> int:
        """Draw `timeline.png` from the demo's spans and the trainer's `timeline.jsonl` as they
        are now (again after the stack stopped, so the trainer's stop checkpoint is in it);
        returns the malformed lines skipped. Nothing before `run` set the origin."""
        if self.timeline_origin is None:
            return 0
        return plot_timeline(
            [*self.timeline, *read_timeline_lines(self.trainer_timeline)],
            self.out / "timeline.png",
            origin=self.timeline_origin,
            title=f"Flywheel demo timeline ({self.cfg.mode}, max_staleness {self.staleness})",
        )

    def run(self, started_at: float | None = None) -> dict[str, object]:
        """Run the whole demo; writes metrics.jsonl, demo_timeline.jsonl, reward_curve.png,
        timeline.png and summary.json into `out`.

        On KeyboardInterrupt (Ctrl-C, or SIGTERM under `stop_on_signals`) it writes what the
        steps done so far give (`write_interrupted`: summary.json marked `interrupted` with
        `step_reached`, reward_curve.png, timeline.png), cancels the episodes not yet begun and
        raises the KeyboardInterrupt again; `interrupted` then holds that summary.

        Args:
            started_at: `time.monotonic()` when the demo command began (stack start-up
                included in `minutes`); None = now.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic() if started_at is None else started_at
        self.timeline_origin = time.time() - (time.monotonic() - t0)  # unix seconds
        self.timeline = []
        self.steps, self.rewards, self.eval_points = [], [], {}
        (self.out / "demo_timeline.jsonl").write_text("")
        try:
            return self._run(t0)
        except KeyboardInterrupt:
            self.stopping.set()  # in-flight episodes end at their next request, quietly
            self.pool.shutdown()
            if self.in_flight:
                self.echo(f"{self.in_flight} in-flight episodes cancelled")
            self.interrupted = self.write_interrupted(t0)
            raise
        except StepFailed as exc:
            self.interrupted = self.write_interrupted(t0, stopped=str(exc))
            raise

    def _run(self, t0: float) -> dict[str, object]:
        eval_before = self._timed_evaluate(0)
        version0 = self.engine_version()
        self.echo(
            f"eval before training: held-out greedy accuracy {_score(eval_before)} "
            f"(weight version {version0})"
        )
        lead = 1 + self.staleness
        first = f"{version0} + s - {lead}" if version0 else f"s - {lead}"
        self.echo(
            f"mode {self.cfg.mode}: rollouts of step s begin once the engine serves weight "
            f"version {first} (or later)"
        )
        batches = self.batches()
        steps, rewards = self.steps, self.rewards
        metrics_path = self.out / "metrics.jsonl"
        with metrics_path.open("w") as f:
            for step in range(1, self.cfg.steps + 1):
                began = time.monotonic()
                served = self.wait_to_start(step, version0)
                waited = time.monotonic() - began
                start = time.time()
                step_rewards = self.rollouts(next(batches))
                self._record("rollout", step, start, time.time())
                mean = sum(step_rewards) / len(step_rewards)
                steps.append(step)
                rewards.append(mean)
                seconds = time.monotonic() - began
                row = {
                    "step": step,
                    "reward_mean": mean,
                    "weight_version": version0 + step,
                    "engine_version": served,
                    "seconds": round(seconds, 2),
                    "wait_seconds": round(waited, 2),
                    "samples": len(step_rewards),
                    "failed_episodes": self.failed,
                    **self.row_extra(),
                }
                f.write(json.dumps(row) + "\n")
                f.flush()
                if self.failed == len(step_rewards):
                    steps.pop(), rewards.pop()  # no Sample: not a step the trainer can train
                    raise StepFailed(step, self.failed, self.first_error, self.logs)
                self.echo(
                    f"step {step:3d}  reward {mean:.3f}  weight_version {version0 + step}  "
                    f"rollouts on version {served}  {seconds:.1f}s"
                )
        # The trainer may still have up to staleness + 1 steps to train and push.
        self.wait_for_version(
            version0 + self.cfg.steps, self.cfg.step_timeout_s * (1 + self.staleness)
        )
        eval_after = self._timed_evaluate(len(steps))
        self._draw()
        summary = {
            **self._reward_windows(),
            "eval_before": eval_before,
            "eval_after": eval_after,
            "steps": len(steps),
            "minutes": (time.monotonic() - t0) / 60,
            **self.summary_extra(),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.echo(summary_line(summary))
        return summary

    def _reward_windows(self) -> dict[str, float | None]:
        """`first5`/`last5`: the mean training reward of the first and last 5 steps done; both
        None with fewer than 10 steps done, where the windows would share steps (one step:
        the same reward twice), so a short run reports its held-out accuracy only."""
        if len(self.rewards) < 2 * REWARD_WINDOW:
            return {"first5": None, "last5": None}
        first, last = self.rewards[:REWARD_WINDOW], self.rewards[-REWARD_WINDOW:]
        return {"first5": sum(first) / len(first), "last5": sum(last) / len(last)}

    def _draw(self) -> None:
        """reward_curve.png of the steps done and the evaluations ended; timeline.png."""
        plot_rewards(
            self.steps,
            self.rewards,
            self.eval_points,
            self.out / "reward_curve.png",
            self.plot_title,
        )
        malformed = self.draw_timeline()
        if malformed:
            self.echo(
                f"timeline.png: skipped {malformed} malformed line(s) of {self.trainer_timeline}"
            )

    def write_interrupted(self, t0: float, stopped: str | None = None) -> dict[str, object]:
        """After an interrupt: summary.json with what the run reached, marked `interrupted`
        (`step_reached`: the last step whose rollouts ended, 0 = none; `eval_after` None),
        reward_curve.png and timeline.png of those steps. metrics.jsonl already holds their
        rows. Returns the summary; it also names the files in `files`. `stopped`: why the run
        stopped itself (`StepFailed`), then `interrupted` is false and `stopped` says why."""
        summary: dict[str, object] = {
            "interrupted": stopped is None,
            **({"stopped": stopped} if stopped else {}),
            "step_reached": len(self.steps),
            **self._reward_windows(),
            "eval_before": self.eval_points.get(0),
            "eval_after": None,
            "steps": len(self.steps),
            "minutes": (time.monotonic() - t0) / 60,
        }
        path = self.out / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        files = [path]
        try:
            self._draw()
            files += [self.out / "reward_curve.png", self.out / "timeline.png"]
        except Exception as exc:  # noqa: BLE001 (the summary is written; say why no plot)
            self.echo(f"reward_curve.png / timeline.png not drawn: {type(exc).__name__}: {exc}")
        if (self.out / "metrics.jsonl").exists():
            files.append(self.out / "metrics.jsonl")
        summary["files"] = [str(f) for f in files]
        return summary

    plot_title = "Flywheel demo: single-digit addition, SmolLM2-135M-Instruct"
    """Title of reward_curve.png."""

    def batches(self) -> Iterator[list[Any]]:
        """The training problems, `problems_per_step` per step."""
        return training_batches(self.cfg.seed, self.cfg.problems_per_step)

    def row_extra(self) -> dict[str, object]:
        """More fields for the step's row of metrics.jsonl (after `rollouts`); none here."""
        return {}

    def summary_extra(self) -> dict[str, object]:
        """More fields for summary.json and the summary line (after the last evaluation)."""
        return {}


def _score(value: float | None) -> str:
    """An accuracy with 3 decimals; None (not measured) as "n/a"."""
    return "n/a" if value is None else f"{value:.3f}"


_echo_lock = threading.Lock()


def echo_line(line: str) -> None:
    """The runner's default `echo`: `line` and its newline in one write, under a lock, so the
    lines of episodes that fail at once on pool threads never run together (`print` writes
    the text and the newline separately)."""
    with _echo_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


SUMMARY_KEYS = ("first5", "last5", "eval_before", "eval_after", "steps", "minutes")


def summary_line(summary: dict[str, object]) -> str:
    """`reward first5=... last5=... eval_before=... eval_after=... steps=N minutes=M` and then
    any further fields as `key=value` (floats with 3 decimals, None as `n/a`)."""

    def value(key: str, v: object) -> str:
        if v is None:
            return "n/a"
        if key == "minutes":
            return f"{float(v):.1f}"  # type: ignore[arg-type]
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = [*SUMMARY_KEYS, *(k for k in summary if k not in SUMMARY_KEYS)]
    return "reward " + " ".join(f"{k}={value(k, summary[k])}" for k in keys if k in summary)
