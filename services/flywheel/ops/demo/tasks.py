"""Procedural verifiable task: single-digit addition with a last-integer reward.

"What is 7 + 1? Answer with just the number." -> reward 1 when the last integer of the reply
is 8. The 100 (a, b) pairs are split once, by a fixed seed, into disjoint training and held-out
sets, so evaluation never sees a training problem.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

PROMPT = "What is {a} + {b}? Answer with just the number."
EVAL_SIZE = 30
SPLIT_SEED = 1234


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return PROMPT.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def task(self) -> dict[str, object]:
        """Session task metadata for the reward service."""
        return {"answer": self.answer, "verifier": "last_integer", "question": self.question}


def split() -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems): disjoint, EVAL_SIZE held out, fixed by SPLIT_SEED."""
    problems = [Problem(a, b) for a in range(10) for b in range(10)]
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def training_batches(seed: int, per_step: int) -> Iterator[list[Problem]]:
    """Endless stream of `per_step` training problems per step (reshuffled each epoch)."""
    train, _ = split()
    rng = random.Random(seed)
    pool: list[Problem] = []
    while True:
        batch: list[Problem] = []
        while len(batch) < per_step:
            if not pool:
                pool = train[:]
                rng.shuffle(pool)
            batch.append(pool.pop())
        yield batch
