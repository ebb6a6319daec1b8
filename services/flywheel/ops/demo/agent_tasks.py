"""The tool-using task: add two 6-digit numbers with a calculator tool; exact-answer reward.

"What is 483920 + 718263?" The agent has one tool, `add(a, b)`. A 135M model cannot add two
6-digit numbers in its head; with the tool it must (1) emit a well-formed call with both numbers
copied exactly, (2) read the tool's output and (3) answer with that number: two model turns.

Held-out and training problems are disjoint by construction: a pair (a, b) is held out when
`(a + 3 * b) % HOLD_OUT_MOD == 0` (one pair in 7); training draws skip those pairs and
evaluation draws only those. Any number of evaluation draws (seeds) stay disjoint from training.

The verifier (`episode_reward`) is the environment's reward at the finish: 1.0 when the final
reply is a well-formed answer whose number equals a + b, else 0.0; a final reply that is (or
holds) a tool call the gateway could not parse is malformed and scores 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

PROMPTS = (
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "Compute the sum of {a} and {b}.",
    "{a} plus {b} equals what?",
    "A shop sold {a} items in May and {b} in June. How many items did it sell in total?",
    "Total of {a} and {b}, please.",
)
"""Phrasings of the question; the agent's worked example uses only the first."""
EVAL_SIZE = 30
LOW, HIGH = 100_000, 999_999
"""Operands are 6-digit numbers: sums have 6 or 7 digits."""
HOLD_OUT_MOD = 7
TRAIN_SEED_OFFSET = 7919
"""Training draws use seed + this, so a training seed never replays an evaluation draw."""

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
_CALL_MARKUP = re.compile(r"<\s*/?\s*tool_call|\"name\"\s*:|\"arguments\"\s*:|\btool_call\b")


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int
    phrasing: int = 0
    """Index into PROMPTS."""

    @property
    def question(self) -> str:
        return PROMPTS[self.phrasing].format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def task(self) -> dict[str, object]:
        """Session task metadata: the environment posts the reward at the finish, so the reward
        service runs no verifier of its own ("none")."""
        return {"answer": self.answer, "verifier": "none", "question": self.question}


def is_held_out(a: int, b: int) -> bool:
    """Whether (a, b) belongs to the held-out set: (a + 3b) mod 7 == 0.

    Example: (100000, 100002): 100000 + 300006 = 400006 = 7 * 57143 + 5 -> False;
    (100001, 100002): 400007 = 7 * 57143 + 6 -> False; (100002, 100002): 400008 = 7 * 57144
    -> True.
    """
    return (a + 3 * b) % HOLD_OUT_MOD == 0


def _draw(rng: random.Random, held_out: bool) -> AdditionProblem:
    while True:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        phrasing = rng.randrange(len(PROMPTS))
        if is_held_out(a, b) == held_out:
            return AdditionProblem(a, b, phrasing)


def held_out(seed: int = 0, size: int = EVAL_SIZE) -> list[AdditionProblem]:
    """`size` held-out problems drawn with `seed` (a different seed = a different draw)."""
    rng = random.Random(seed)
    return [_draw(rng, held_out=True) for _ in range(size)]


def training_batches(seed: int, per_step: int) -> Iterator[list[AdditionProblem]]:
    """Endless stream of `per_step` fresh training problems per step (never held out)."""
    rng = random.Random(seed + TRAIN_SEED_OFFSET)
    while True:
        yield [_draw(rng, held_out=False) for _ in range(per_step)]


def has_call_markup(text: str) -> bool:
    """Whether `text` holds tool-call markup (`<tool_call>`, a `"name": ...` object): a final
    reply with it is a tool call the gateway's parser could not read, i.e. a malformed call."""
    return bool(_CALL_MARKUP.search(text))


def parse_answer(text: str) -> int | None:
    """The number a final reply answers with, or None when the reply is malformed.

    Well-formed: no tool-call markup and at least one integer; the answer is the last integer
    (thousands separators allowed: "1,202,183" -> 1202183). Examples: "1202183" -> 1202183;
    "The sum is 1202183." -> 1202183; "" -> None; "I don't know" -> None;
    '<tool_call>{"name": "add"' -> None.
    """
    if has_call_markup(text):
        return None
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return int(numbers[-1].replace(",", ""))


def episode_reward(final_output: str, answer: int, *, malformed_calls: int = 0) -> float:
    """The environment's reward at the finish: 1.0 when the final reply's number equals
    `answer` and the episode made no malformed tool call, else 0.0.

    Examples (answer 1202183): "1202183" -> 1.0; "The answer is 1,202,183" -> 1.0;
    "1202184" -> 0.0; "" -> 0.0; "1202183" with malformed_calls=1 -> 0.0;
    '<tool_call>{"name": "add", "arguments": {"a": 1}}' -> 0.0 (an unparsed call).
    """
    if malformed_calls:
        return 0.0
    return 1.0 if parse_answer(final_output) == answer else 0.0
