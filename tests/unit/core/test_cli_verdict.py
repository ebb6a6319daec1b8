"""The demo's closing line: a short run says it cannot compare reward windows instead of
reporting no learning; 10+ steps compare last5 with first5 and held-out accuracy."""

from flywheel.ops.cli import learning_verdict


def test_short_run_reports_held_out_and_asks_for_more_steps():
    line = learning_verdict(
        {"first5": 0.219, "last5": 0.219, "eval_before": 0.667, "eval_after": 0.8, "steps": 4}
    )
    assert line.startswith("held-out accuracy 0.667 -> 0.800")
    assert "too few steps (4)" in line and "no measurable" not in line


def test_ten_steps_compare_both_windows():
    base = {"first5": 0.2, "eval_before": 0.667, "steps": 30}
    assert learning_verdict({**base, "last5": 0.8, "eval_after": 0.9}).startswith(
        "the policy learned"
    )
    # reward up but held-out accuracy down: not called learning
    assert learning_verdict({**base, "last5": 0.8, "eval_after": 0.6}).startswith(
        "no measurable learning"
    )
