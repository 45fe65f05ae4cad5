import os
import shlex
from typing import NamedTuple

# CPU unless the caller chose: `JAX_PLATFORMS=cuda` (or set and empty, for
# JAX's own choice) runs the suite on a GPU (README, "Running the tests on a
# GPU"). There the tests that assert what XLA:CPU compiles skip, saying so
# (`_helpers.xla_cpu_only`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes (pytest -n) share one GPU: allocate as needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA:CPU's LLVM back end at -O0 compiles a sixth faster, to the same
# optimized HLO and buffers (test_compile_options.py checks that on each
# JAX the suite runs at -O0). Not where the GPU and TPU compiles run, nor
# with OPTAX_EXT_XLA_DEFAULTS set, nor where XLA_FLAGS names a level
# (docs/contributing.md).
FAST_CPU_FLAG = "--xla_backend_optimization_level=0"
if (
    os.environ["JAX_PLATFORMS"] == "cpu"
    and os.environ.get("OPTAX_EXT_DEVICELESS") != "here"
    and not os.environ.get("OPTAX_EXT_XLA_DEFAULTS")
    and FAST_CPU_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_FLAG}"

import hypothesis  # noqa: E402
import jax  # noqa: E402

if jax.default_backend() != "cpu":
    # The references are float64 or plain optax at full float32 precision;
    # a GPU's default float32 matmul (TF32 inputs) is not what they check.
    jax.config.update("jax_default_matmul_precision", "highest")

# Each hypothesis example compiles JAX code: keep examples few and untimed.
hypothesis.settings.register_profile(
    "optax_ext", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile("optax_ext")

import pytest  # noqa: E402

MULTIDEVICE_FLAG = "--xla_force_host_platform_device_count=8"


# The tests that run a child pytest or processes, longest first: each
# runs for minutes, where most tests take a second or less.
LONG_FIRST = [
    "test_deviceless_runner.py::test_gpu_and_tpu_compile_checks_pass",
    "test_multidevice_runner.py::test_multidevice_tests_pass_on_8_cpu_devices",
    "test_newest_jax_runner.py::test_compiled_checks_pass_with_the_newest_jax",
    "test_deviceless_runner.py::test_sharded_checks_pass_with_jaxlib_0_11",
    "test_gpu_check.py::test_quick_run_times_and_sizes_every_step_and_writes_its_report",
    "test_multiprocess.py::test_two_processes_train_as_one_process_on_the_whole_batch",
]


def _long_first(items, workers):
    """`items` reordered so that under `pytest -n W --dist worksteal`
    (`pytest_configure`) the long tests start at once, dealt in turn to the
    start of each worker's first share: none waits behind another while a
    worker runs short tests, and the other tests fill in around them."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    long = sorted(
        (item for item in items if item.nodeid.rpartition("/")[2] in rank),
        key=lambda item: rank[item.nodeid.rpartition("/")[2]],
    )
    rest = [item for item in items if item.nodeid.rpartition("/")[2] not in rank]
    ordered = []
    for w in range(workers):
        mine = long[w::workers]
        # worksteal gives worker w the next len(pending) // (workers - w).
        share = (len(items) - len(ordered)) // (workers - w)
        take = max(0, share - len(mine)) if w < workers - 1 else len(rest)
        ordered += mine + rest[:take]
        rest = rest[take:]
    items[:] = ordered


def pytest_configure(config):
    """`pytest -n W` without `--dist` schedules by worksteal, the shares
    `_long_first` deals for. (In `addopts` the option would make a run
    without xdist, `pytest -p no:xdist`, fail.) An explicit `--dist` or
    `-d` (in the arguments or `PYTEST_ADDOPTS`) is kept, as are the
    workers' own configs, whose `dist` reads "no"."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    args = [
        *config.invocation_params.args,
        *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
    ]
    given = config.getoption("distload") or any(a.startswith("--dist") for a in args)
    if config.getoption("dist") == "load" and not given:
        config.option.dist = "worksteal"


# `pytest -n 2 --quick tests`: the public contracts, for a check in
# minutes while changing code (README). Each file tests public names
# against their references; the README's blocks are the front page's
# promise. Left out: the child runs (other devices, JAX versions and
# targets), compiled memory and HLO, docs pages, aliases one by one,
# upstream optax's own failures and the code's shape.
QUICK = {
    "test_multi_steps.py",
    "test_zero_nans.py",
    "test_inject.py",
    "test_apply.py",
    "test_emit.py",
    "test_weighted.py",
    "test_microbatched.py",
    "test_skip_when.py",
    "test_stop_gradient.py",
    "test_compose.py",
    "test_equality.py",
    "test_nnx.py",
    "test_linen.py",
    "test_drop_in_claims.py",
    "test_docs.py::test_python_blocks_of_page_run_in_order[README.md]",
}
# Tests of those files that `--quick` leaves out all the same: compiled memory.
NOT_QUICK = {"test_apply.py::test_fused_step_has_no_params_sized_temporary"}


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="run only the public contracts (tests/conftest.py QUICK): minutes",
    )


def _keep_quick(config, items):
    """With `--quick`, deselects every test outside QUICK."""
    if not config.getoption("quick"):
        return
    kept, dropped = [], []
    for item in items:
        path, _, test = item.nodeid.partition("::")
        file = path.rpartition("/")[2]
        quick = file in QUICK or f"{file}::{test}" in QUICK
        quick = quick and f"{file}::{test.partition('[')[0]}" not in NOT_QUICK
        (kept if quick else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The long tests first (`_long_first`), after `-k`, `-m` and
    `--deselect` have chosen the items (hence `trylast`): in an xdist
    worker dealt over the workers, without xdist all at the start. (A
    worker's own `dist` option reads "no" whatever the run's is: the
    shares are worksteal's, and under `load` they only move the long
    tests to where a worker will soon ask for them.)"""
    workerinput = getattr(config, "workerinput", None)
    workers = 1 if workerinput is None else int(workerinput["workercount"])
    _keep_quick(config, items)
    _long_first(items, workers)
    _skip_multidevice(items)


def _skip_multidevice(items):
    """Multi-device tests run only in a process that has 8 devices; the main
    run starts such a process in `test_multidevice_runner.py`."""
    marked = [item for item in items if item.get_closest_marker("multidevice")]
    if not marked:
        return
    if jax.device_count() >= 8:
        return
    skip = pytest.mark.skip(
        reason=f"needs 8 devices: run by test_multidevice_runner.py with "
        f"XLA_FLAGS={MULTIDEVICE_FLAG}"
    )
    for item in marked:
        item.add_marker(skip)


class WindowForm(NamedTuple):
    """A form of the drop-in's step (`window_form`): `form(opt)` is the
    `MultiSteps` `opt` configured to run in it. "every step" clears the
    accumulator where a window ends, as on a TPU; a GPU's form keeps it
    (`clear=False`)."""

    name: str

    def __call__(self, opt, clear=True):
        from optax_ext._accumulate import xla

        every = frozenset({"cpu", "cuda", "rocm", "tpu"})
        conditional = self.name == "conditional"
        return xla.configured(
            opt,
            drop_in_conditional_on=every if conditional else frozenset(),
            clear_when_selected_on=every if clear else frozenset(),
        )


@pytest.fixture(params=["conditional", "every step"])
def window_form(request):
    """Runs a test with each form of the drop-in's step: the inner
    optimizer in a conditional, or on every step with its results
    selected (as on GPUs and TPUs). Which one a program gets depends on
    the backend (`xla.Mechanisms.drop_in_conditional_on`), so the tests
    that take this fixture build their `MultiSteps` in each form,
    `window_form(opt)`, and check both, whatever runs them."""
    return WindowForm(request.param)
