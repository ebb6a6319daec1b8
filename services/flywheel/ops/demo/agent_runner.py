"""The tool-using demo (`flywheel demo --task agent`): the same loop as `DemoRunner`, with the
`openai-agents` calculator agent (`tool_agent.py`) on 6-digit additions (`agent_tasks.py`).

Each episode is one gateway session in episode mode (`group_id` per problem, G episodes per
group): the agent calls the model, the tool runs, the model answers; the runner scores the final
reply (`agent_tasks.episode_reward`) and finishes the session with that reward, which the Samples
carry as `rewards["outcome"]` (the task names no verifier). The recorded Sample of an episode
holds every model turn with loss mask 1 and the tool output and chat template between them with
mask 0.

Evaluation (greedy, evaluation sessions) reports task success, the fraction of episodes that
ran the tool (`tool_use`) and the fraction of tool-call attempts that were well formed
(`well_formed`: calls the tool ran over those plus malformed ones; None when no episode tried).
Before training it evaluates two held-out draws (`eval_seed`, `eval_seed + 1`): with greedy
decoding their difference is the evaluation's noise from the draw of problems. A draw whose every
episode failed measured nothing: its stats are None (null in summary.json, n/a in the lines) and
the line says how many failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from flywheel.ops.demo.agent_tasks import (
    EVAL_SIZE,
    AdditionProblem,
    episode_reward,
    has_call_markup,
    held_out,
    training_batches,
)
from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.demo.tool_agent import MAX_TURNS, run_episode


@dataclass
class EpisodeResult:
    """One episode: its reward and what the agent did."""

    reward: float
    tool_calls: int
    """Calls the tool ran (well formed)."""
    malformed_calls: int
    """Calls that did not parse or validate (unknown tool, bad arguments, unparsed markup)."""


@dataclass
class EvalStats:
    """Aggregate of a list of episodes (fractions in [0, 1]; None when every episode failed:
    nothing was measured)."""

    success: float | None
    tool_use: float | None
    """Episodes with at least one tool call the tool ran."""
    well_formed: float | None
    """Well-formed calls over all call attempts; None when no episode tried a call."""
    episodes: int
    failed: int = 0
    """Episodes the gateway failed or refused (scored 0)."""

    @classmethod
    def of(cls, results: list[EpisodeResult], failed: int = 0) -> EvalStats:
        """Example: rewards [1, 0, 0], tool_calls [1, 1, 0], malformed [0, 1, 0] ->
        success 1/3, tool_use 2/3, well_formed 2 / (2 + 1) = 2/3. With `failed` episodes
        covering all of `results`, every fraction is None."""
        if results and failed >= len(results):
            return cls(None, None, None, episodes=len(results), failed=failed)
        n = max(len(results), 1)
        ran = sum(r.tool_calls for r in results)
        attempts = ran + sum(r.malformed_calls for r in results)
        return cls(
            success=sum(r.reward for r in results) / n,
            tool_use=sum(1 for r in results if r.tool_calls) / n,
            well_formed=ran / attempts if attempts else None,
            episodes=len(results),
            failed=failed,
        )


@dataclass
class AgentDemoConfig(DemoConfig):
    max_tokens: int = 48
    """Completion tokens per model turn (a call is about 30 tokens)."""
    temperature: float = 0.7
    """Sampling temperature of the training episodes. At 1.0 the untrained model's calls fall
    apart (1 of 8 "What is a + b?" episodes succeeded, the others wrote broken JSON, unknown
    tools or answers from its head); at 0.7, 6 of 8 (2026-12-02)."""
    max_turns: int = MAX_TURNS
    eval_seed: int = 0
    """Held-out draw of the evaluations; the second untrained evaluation uses eval_seed + 1."""
    eval_size: int = EVAL_SIZE
    example: bool = True
    """Show the agent one worked tool round trip before the question."""


class AgentDemoRunner(DemoRunner):
    """`DemoRunner` with the tool-using agent; `run` writes the same files and summary plus
    `eval_before_seed2`, `tool_use_*`, `well_formed_*` and `train_tool_use` (per step)."""

    cfg: AgentDemoConfig
    plot_title = "Flywheel demo-agent: 6-digit addition with a calculator tool, SmolLM2-135M"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.evals: list[tuple[int, EvalStats]] = []
        """(held-out draw seed, stats) of every evaluation, in order."""
        self.step_results: list[EpisodeResult] = []

    def agent_episode(
        self, problem: AdditionProblem, group_id: str, *, evaluation: bool, temperature: float
    ) -> EpisodeResult:
        """One session: create, run the agent, score, finish with the reward. A session the
        gateway refuses or fails to create or finish is scored 0, counted and logged
        (`DemoRunner._failed_episode`)."""
        try:
            session = self.open_session(group_id, problem.task, evaluation=evaluation)
        except httpx.HTTPError as exc:
            self._failed_episode(None, exc)
            return EpisodeResult(0.0, 0, 0)
        trace = run_episode(
            session["base_url"],
            problem.question,
            model=self.cfg.model,
            temperature=temperature,
            max_tokens=self.cfg.max_tokens,
            api_key=self.agent_key,
            stopping=self.stopping,
            max_turns=self.cfg.max_turns,
            example=self.cfg.example,
        )
        malformed = trace.malformed_calls + (1 if has_call_markup(trace.final_output) else 0)
        reward = episode_reward(trace.final_output, problem.answer, malformed_calls=malformed)
        if trace.api_error is not None:
            # Finished with reward 0 like any failed episode, so its group still fills; counted
            # in the step's `failed_episodes` and said here.
            self._failed_episode(session, trace.api_error)
            return EpisodeResult(0.0, len(trace.tool_calls), malformed)
        try:
            self.finish_session(session["session_id"], {"reward": reward})
        except httpx.HTTPError as exc:
            self._failed_episode(session, exc)
            return EpisodeResult(0.0, len(trace.tool_calls), malformed)
        return EpisodeResult(reward, len(trace.tool_calls), malformed)

    def evaluate_draw(self, seed: int) -> EvalStats:
        """Greedy evaluation on the held-out draw `seed`; its failed episodes are counted in
        its line (every one failed: not measured, stats None)."""
        problems = held_out(seed, self.cfg.eval_size)
        self.echo(f"evaluating {len(problems)} held-out problems (draw {seed}, greedy)...")
        failed_before = self.failed
        results = self.in_pool(
            lambda p: self.agent_episode(p, "", evaluation=True, temperature=0.0), problems
        )
        stats = EvalStats.of(results, failed=self.failed - failed_before)
        self.evals.append((seed, stats))
        if stats.success is None:
            self.echo(f"  not measured: all {stats.failed} episodes of draw {seed} failed")
            return stats
        failed = f"  ({stats.failed} failed, scored 0)" if stats.failed else ""
        self.echo(
            f"  success {stats.success:.3f}  tool_use {_fmt(stats.tool_use)}  well_formed "
            f"{_fmt(stats.well_formed)}{failed}"
        )
        return stats

    def evaluate(self) -> float | None:
        """Task success on the held-out draw `eval_seed` (None: not measured); before training
        (no evaluation yet) also on draw `eval_seed + 1`, the noise check."""
        first = not self.evals
        stats = self.evaluate_draw(self.cfg.eval_seed)
        if first:
            self.evaluate_draw(self.cfg.eval_seed + 1)
        return stats.success

    def rollouts(self, problems: list[AdditionProblem]) -> list[float]:  # type: ignore[override]
        self.step_results = self.run_groups(
            problems,
            lambda problem, group_id: self.agent_episode(
                problem, group_id, evaluation=False, temperature=self.cfg.temperature
            ),
        )
        return [r.reward for r in self.step_results]

    def row_extra(self) -> dict[str, object]:
        stats = EvalStats.of(self.step_results)
        return {
            "tool_use": stats.tool_use,
            "well_formed": stats.well_formed,
            "failed_episodes": self.failed,
        }

    def summary_extra(self) -> dict[str, object]:
        before, second, after = self.evals[0][1], self.evals[1][1], self.evals[-1][1]
        return {
            "eval_before_seed2": second.success,
            "tool_use_before": before.tool_use,
            "tool_use_after": after.tool_use,
            "well_formed_before": before.well_formed,
            "well_formed_after": after.well_formed,
        }

    def batches(self) -> Iterator[list[AdditionProblem]]:
        return training_batches(self.cfg.seed, self.cfg.problems_per_step)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
