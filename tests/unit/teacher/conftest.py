from __future__ import annotations

import pytest

from flywheel.teacher.context import TeacherRenderer


@pytest.fixture(scope="session")
def renderer(tiny_model_dir):
    return TeacherRenderer(tiny_model_dir)
