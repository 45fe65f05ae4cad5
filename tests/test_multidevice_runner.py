"""Runs the multi-device tests in a process with 8 CPU devices.

`XLA_FLAGS` must be set before JAX creates its CPU backend, which the main
test process has done long before, so the tests marked `multidevice` run in
a child pytest process started here with the flag set.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from conftest import MULTIDEVICE_FLAG

TESTS = pathlib.Path(__file__).parent


@pytest.mark.skipif(
    jax.device_count() >= 8, reason="this process has 8 devices: they run here"
)
def test_multidevice_tests_pass_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MULTIDEVICE_FLAG}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", "multidevice", str(TESTS)],
        env=env,
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=1200,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, (
        f"multi-device tests failed ({summary[0]}):\n"
        f"{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
    )
    # Nothing is skipped there, but the docs page written for jax.lax.pcast
    # on a JAX without it (test_docs.py says why).
    skipped = re.search(r"(\d+) skipped", summary[0])
    expected = 0 if hasattr(jax.lax, "pcast") else 1
    assert " passed" in summary[0], summary[0]
    assert (int(skipped.group(1)) if skipped else 0) == expected, summary[0]
