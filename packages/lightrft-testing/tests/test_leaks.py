"""``no_leaks`` fails the test that leaks, names what leaked, and cleans up after it."""

from __future__ import annotations

import pytest

CONFTEST = """
import pytest

@pytest.fixture(autouse=True)
def _police(no_leaks):
    pass
"""

LEAKY = """
import os, threading

import torch.distributed as dist

def test_leaves_a_group():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)

def test_next_test_starts_without_it():
    assert not dist.is_initialized()

def test_sets_a_variable():
    os.environ["LIGHTRFT_LEAK_PROBE"] = "1"

def test_the_variable_is_gone_after():
    assert "LIGHTRFT_LEAK_PROBE" not in os.environ

def test_changes_a_variable_with_monkeypatch(monkeypatch):
    monkeypatch.setenv("LIGHTRFT_LEAK_PROBE", "2")

def test_leaves_a_thread():
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="forgotten", daemon=True).start()

def test_clean():
    pass
"""


def test_each_leak_fails_its_own_test_and_the_next_starts_clean(
    pytester: pytest.Pytester,
) -> None:
    from lightrft.testing.launcher import find_free_port

    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_leaky=LEAKY.replace("{port}", str(find_free_port())))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=7, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_a_group*",
            "*a process group is still initialised (close the strategy*",
            "*ERROR at teardown of test_sets_a_variable*",
            "*environment variable LIGHTRFT_LEAK_PROBE='1' was set*",
            "*ERROR at teardown of test_leaves_a_thread*",
            "*daemon thread 'forgotten' (Thread) is still running*",
        ]
    )
