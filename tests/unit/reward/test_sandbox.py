import time

import pytest

from flywheel.reward.sandbox import Limits, code_tests, extract_code, isolation_mode, run_test

ADD = "def add(a, b):\n    return a + b\n"
FAST = Limits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_output_bytes=4096)


def test_extract_code_takes_the_last_python_block():
    reply = "Try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\n"
    assert extract_code(reply) == "x = 2\n"


def test_passing_and_failing_tests_give_the_fraction():
    reply = f"```python\n{ADD}```"
    task = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"], "timeout_s": 5}
    assert code_tests(reply, task) == 0.5


def test_infinite_loop_is_a_failed_test_not_a_hang():
    t0 = time.monotonic()
    result = run_test("while True:\n    pass\n", "pass", Limits(timeout_s=1.0, cpu_s=30))
    assert not result.passed and result.reason == "timeout"
    assert time.monotonic() - t0 < 5


def test_cpu_limit_kills_a_busy_child_before_the_wall_clock():
    # wall clock 60 s: on a loaded machine 1 s of CPU can take many seconds of wall time
    result = run_test("while True:\n    pass\n", "pass", Limits(timeout_s=60.0, cpu_s=1))
    assert not result.passed and result.reason != "timeout"


def test_huge_allocation_fails():
    result = run_test("x = bytearray(2 * 1024**3)\n", "pass", FAST)
    assert not result.passed and "MemoryError" in result.output


def test_huge_output_is_cut_and_fails():
    result = run_test("print('x' * 10**7)\n", "pass", FAST)
    assert not result.passed
    assert len(result.output) <= 2000


def test_network_connection_is_refused():
    code = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2).close()\n"
    result = run_test(code, "pass", FAST)
    assert not result.passed
    expected = "unreachable" if isolation_mode() == "unshare" else "not allowed"
    assert expected in result.output


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "print('PASS')\nimport os\nos._exit(0)\n",
    ],
)
def test_early_exit_cannot_fake_a_pass(code):
    assert not run_test(code, "assert False", FAST).passed


def test_cwd_is_a_fresh_temp_dir():
    code = "import os\nassert os.listdir('.') == ['.out']\nopen('f.txt', 'w').write('ok')\n"
    assert run_test(code, "assert open('f.txt').read() == 'ok'", FAST).passed
