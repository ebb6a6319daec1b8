"""Fixtures of the reward tests: a fake OpenAI-compatible judge over real HTTP."""

import pytest

from flywheel.reward.fake_judge import FakeJudge


@pytest.fixture
def fake_judge():
    judge = FakeJudge()
    yield judge
    judge.close()
