"""Runs the XLA:CPU compiled-memory and structure tests with the JAX a new
user installs today (`tests/data/newest-requirements.txt`: jax 0.12.0.1,
Python 3.12 or newer), beside the main run's JAX: `.venv-newest`, or the
Python named by `OPTAX_EXT_NEWEST_PYTHON`. Without one they skip, saying
how to build it; under `.ci/run` (`OPTAX_EXT_NEWEST=required`) they fail.
"""

import os
import pathlib

import pytest
from _helpers import child_pytest

TESTS = pathlib.Path(__file__).parent
BUILD = (
    "python3.13 -m venv .venv-newest && .venv-newest/bin/pip install "
    "-r tests/data/newest-requirements.txt -e ."
)
# The compiled-structure (HLO) tests and the XLA:CPU cases of the whole
# train step's memory: what a new XLA changes first; that the suite's
# fast XLA:CPU compile gives XLA's default program; the golden bits
# recorded for it (test_golden.py). `nox -s newest` runs the whole suite
# on the newest releases.
FILES = [
    "test_hlo.py",
    "test_train_step_memory.py",
    "test_compile_options.py",
    "test_golden.py",
    "test_drop_in_claims.py",
]


def _python() -> pathlib.Path | None:
    given = os.environ.get("OPTAX_EXT_NEWEST_PYTHON")
    path = pathlib.Path(given) if given else TESTS.parent / ".venv-newest/bin/python"
    return path if path.exists() else None


def test_compiled_checks_pass_with_the_newest_jax():
    python = _python()
    if python is None:
        if os.environ.get("OPTAX_EXT_NEWEST") == "required":
            pytest.fail(f"no newest-JAX environment: build it with `{BUILD}`")
        pytest.skip(f"no newest-JAX environment (`{BUILD}` builds it)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # (at -O0 whatever the parent asked: test_compile_options.py checks it)
    for name in (
        "XLA_FLAGS",
        "OPTAX_EXT_DEVICELESS",
        "OPTAX_EXT_FULL_MATRIX",
        "OPTAX_EXT_XLA_DEFAULTS",
    ):
        env.pop(name, None)
    # `-p _compiled` (tests/ on the path): its hook gives each
    # `xdist_group` (a whole-step case's forms) to one worker under pytest
    # 9.2, so that the case's references compile once, not once per worker.
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])
    )
    summary = child_pytest(
        python,
        [
            "-p",
            "_compiled",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-k",
            "cpu or not (gpu or tpu)",
            "-m",
            "not multidevice",
            *(str(TESTS / f) for f in FILES),
        ],
        env,
        "compiled checks with the newest jax",
    )
    # The GPU and TPU cases are deselected; nothing else may skip.
    assert " passed" in summary and "skipped" not in summary, summary
