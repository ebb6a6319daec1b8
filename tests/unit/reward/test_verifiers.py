import pytest

from flywheel.core.errors import InvalidRequestError
from flywheel.reward.verifiers import VERIFIERS, json_schema, math_answer, numeric, regex


@pytest.mark.parametrize(
    ("reply", "answer", "expected"),
    [
        ("So the result is $\\frac{1}{2}$.", "0.5", 1.0),  # LaTeX fraction == decimal
        ("The answer is \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # boxed wins, simplified
        ("x = 3, so the answer is $x^2 = 9$", "9", 1.0),
        ("The answer is $\\frac{1}{3}$", "0.5", 0.0),
        ("I don't know", "0.5", 0.0),
    ],
)
def test_math_verify(reply, answer, expected):
    assert math_answer(reply, {"answer": answer}) == expected


@pytest.mark.parametrize(
    ("reply", "task", "expected"),
    [
        ("The total is 3.14159", {"answer": 3.14159}, 1.0),
        ("about 3.1416", {"answer": 3.14159, "abs_tol": 1e-3}, 1.0),  # |3.1416-3.14159| = 1e-5
        ("about 3.15", {"answer": 3.14159, "abs_tol": 1e-3}, 0.0),  # off by 8.4e-3
        ("1,234.5 dollars", {"answer": "1234.5"}, 1.0),  # separator removed
        ("6.02e23 atoms", {"answer": 6.0221e23, "rel_tol": 1e-3}, 1.0),  # rel err 3.5e-4
        ("no number", {"answer": 1}, 0.0),
    ],
)
def test_numeric_with_tolerance(reply, task, expected):
    assert numeric(reply, task) == expected


def test_numeric_rejects_a_non_numeric_answer():
    with pytest.raises(InvalidRequestError):
        numeric("1", {"answer": "one"})


@pytest.mark.parametrize(
    ("reply", "task", "expected"),
    [
        ("ANSWER: B", {"pattern": r"ANSWER: [A-D]"}, 1.0),
        ("I think ANSWER: B", {"pattern": r"ANSWER: [A-D]"}, 0.0),  # fullmatch by default
        ("I think ANSWER: B", {"pattern": r"ANSWER: [A-D]", "match": "search"}, 1.0),
        ("<think>x</think>\nok", {"pattern": r"<think>.*</think>\n.+"}, 1.0),  # DOTALL
    ],
)
def test_regex(reply, task, expected):
    assert regex(reply, task) == expected


SCHEMA = {
    "type": "object",
    "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
}


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"name": "Ada", "age": 36}', 1.0),
        ('Here it is:\n```json\n{"name": "Ada", "age": 36}\n```', 1.0),
        ('{"name": "Ada", "age": -1}', 0.0),  # minimum violated
        ('{"name": "Ada"}', 0.0),  # required field missing
        ("{name: Ada}", 0.0),  # not JSON
    ],
)
def test_json_schema(reply, expected):
    assert json_schema(reply, {"schema": SCHEMA}) == expected


def test_json_schema_invalid_schema_is_the_tasks_error():
    with pytest.raises(InvalidRequestError):
        json_schema("{}", {"schema": {"type": "nope"}})


def test_registry_names():
    assert {
        "last_integer",
        "exact",
        "math",
        "numeric",
        "regex",
        "json_schema",
        "code_tests",
    } <= set(VERIFIERS)
