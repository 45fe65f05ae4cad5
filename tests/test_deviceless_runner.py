"""Runs the GPU and TPU compile checks of `test_compiled_backends.py` in
the environment that can compile for an H200 and a TPU v5e without either
(`tests/data/deviceless-requirements.txt`: jax 0.11.2, its CUDA plugin and
libtpu, on Python 3.12): `.venv-deviceless`, or the Python named by
`OPTAX_EXT_DEVICELESS_PYTHON`. Without one the checks skip, saying how to
build it; under `.ci/run` (`OPTAX_EXT_DEVICELESS=required`) they fail.
There, too, the XLA:CPU checks of params sharded under `jax.jit`
(`test_sharded.py`), whose update path differs below jaxlib 0.11, and
the drop-in against optax.MultiSteps on that JAX (`test_drop_in_claims.py`).
"""

import os
import pathlib

import pytest
from _compiled import REQUIRED
from _helpers import child_pytest

TESTS = pathlib.Path(__file__).parent
BUILD = (
    "python3.12 -m venv .venv-deviceless && .venv-deviceless/bin/pip install "
    "-r tests/data/deviceless-requirements.txt -e ."
)


def _python() -> pathlib.Path | None:
    given = os.environ.get("OPTAX_EXT_DEVICELESS_PYTHON")
    path = (
        pathlib.Path(given) if given else TESTS.parent / ".venv-deviceless/bin/python"
    )
    return path if path.exists() else None


def _python_or_skip() -> pathlib.Path:
    python = _python()
    if python is None:
        if REQUIRED:
            pytest.fail(f"no deviceless environment: build it with `{BUILD}`")
        pytest.skip(f"no deviceless environment (`{BUILD}` builds it)")
    return python


def test_gpu_and_tpu_compile_checks_pass():
    python = _python_or_skip()
    env = dict(os.environ, OPTAX_EXT_DEVICELESS="here", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    # `-p _compiled` (tests/ on the path): its hook gives each
    # `xdist_group` to one worker under pytest 9.2, so that a case's
    # reference programs compile once, not once per worker.
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])
    )
    # With the XLA:CPU cases whose form differs below jaxlib 0.11 (Lion,
    # a chain that reduces, a nested MultiSteps): there they fold first.
    # The whole train step's XLA:CPU cases (`no_more_memory`, and the
    # bfloat16 accumulator's, which "accumulator", meant for
    # `test_loops_over_the_accumulator_per_step[cpu]`, also matched) run in
    # the main process (jax 0.10.2 in CI) and with the newest jax
    # (`test_newest_jax_runner.py`), not here. The head-split decoder's open
    # TPU case (xfail, 22.7 s of compiles) runs where OPTAX_EXT_FULL_MATRIX
    # is set (`nox -s deviceless`); here the whole step's TPU bound is
    # `test_no_more_memory_than_optax_multisteps[tpu-mlp-*]`'s.
    keyword = (
        "(gpu or tpu or lion or clip or MultiSteps or accumulator)"
        " and not ((no_more_memory or bfloat16_accumulator) and cpu)"
    )
    if not os.environ.get("OPTAX_EXT_FULL_MATRIX"):
        keyword += " and not head_split"
    args = ["-p", "_compiled", "-n", "2", "--dist", "loadgroup", "-k", keyword]
    summary = child_pytest(
        python,
        [
            *args,
            str(TESTS / "test_compiled_backends.py"),
            str(TESTS / "test_train_step_memory.py"),
            str(TESTS / "test_check_your_step_doc.py"),
        ],
        env,
        "GPU and TPU compile checks",
    )
    assert "skipped" not in summary, summary


def test_sharded_checks_pass_with_jaxlib_0_11():
    """`test_sharded.py`'s structure and memory checks on 8 simulated CPU
    devices with jax 0.11.2, whose XLA:CPU keeps orders that jaxlib 0.10's
    fusion undoes."""
    python = _python_or_skip()
    # At XLA's default level: test_compile_options.py runs on other JAXes.
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        OPTAX_EXT_XLA_DEFAULTS="1",
    )
    env.pop("OPTAX_EXT_DEVICELESS", None)
    # The structure and memory checks (and the per-example outputs' test),
    # whose outcome depends on the XLA; the values (`..._equals_*`) are
    # checked with the main run's jax. And the drop-in against optax on the
    # JAX of the GPU machines (`test_drop_in_claims.py`: one device).
    summary = child_pytest(
        python,
        [
            "-n",
            "2",
            "-k",
            "keeps_buffers or no_more_memory or come_back_whole or claims",
            str(TESTS / "test_sharded.py"),
            str(TESTS / "test_drop_in_claims.py"),
        ],
        env,
        "sharded checks with jax 0.11",
    )
    assert "skipped" not in summary, summary
