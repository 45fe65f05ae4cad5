"""Runs the multi-device tests in a process with 8 CPU devices.

`XLA_FLAGS` must be set before JAX creates its CPU backend, which the main
test process has done long before, so the tests marked `multidevice` run in
a child pytest process started here with the flag set.
"""

import os
import pathlib
import re
import sys

import jax
import pytest
from _helpers import child_pytest
from conftest import MULTIDEVICE_FLAG

TESTS = pathlib.Path(__file__).parent


@pytest.mark.skipif(
    jax.device_count() >= 8, reason="this process has 8 devices: they run here"
)
def test_multidevice_tests_pass_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MULTIDEVICE_FLAG}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    summary = child_pytest(
        sys.executable, ["-m", "multidevice", str(TESTS)], env, "multi-device tests"
    )
    # Nothing is skipped there, but the docs page written for jax.lax.pcast
    # on a JAX without it (test_docs.py says why).
    skipped = re.search(r"(\d+) skipped", summary)
    expected = 0 if hasattr(jax.lax, "pcast") else 1
    assert " passed" in summary, summary
    assert (int(skipped.group(1)) if skipped else 0) == expected, summary


def test_runners_head_the_first_batch_of_each_worker():
    """conftest.runners_first: with 2 workers and 400 tests, pytest-xdist
    sends each worker 50 consecutive tests first; the 4 runners, longest
    first, are tests 0 and 1 of the first batch and 50 and 51 of the
    second, and no test is lost or repeated."""
    from types import SimpleNamespace

    from conftest import RUNNERS, runners_first

    others = [SimpleNamespace(nodeid=f"tests/test_x.py::test_{i}") for i in range(396)]
    runners = [SimpleNamespace(nodeid=f"tests/{name}") for name in RUNNERS]
    items = others[:100] + runners[::-1] + others[100:]
    order = runners_first(items, 2)
    assert sorted(map(id, order)) == sorted(map(id, items))
    assert [order[i] for i in (0, 50, 1, 51)] == runners
    assert [x for x in order if x not in runners] == others
