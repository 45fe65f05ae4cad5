"""Runs the multi-device tests in a process with 8 CPU devices.

`XLA_FLAGS` must be set before JAX creates its CPU backend, which the main
test process has done long before, so the tests marked `multidevice` run in
a child pytest process started here with the flag set.
"""

import os
import pathlib
import re
import sys

import _golden_cases
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
    # on a JAX without it (test_docs.py says why), and the golden bits
    # where none were recorded for this JAX and these XLA flags.
    skipped = re.search(r"(\d+) skipped", summary)
    expected = 0 if hasattr(jax.lax, "pcast") else 1
    expected += _golden_cases.multidevice_skips()
    assert " passed" in summary, summary
    assert (int(skipped.group(1)) if skipped else 0) == expected, summary
