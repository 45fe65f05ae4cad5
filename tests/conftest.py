import os

# CPU unless the caller chose: `JAX_PLATFORMS=cuda` (or set and empty, for
# JAX's own choice) runs the suite on a GPU (README, "Running the tests on a
# GPU"). There the tests that assert what XLA:CPU compiles skip, saying so
# (`_helpers.xla_cpu_only`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes (pytest -n) share one GPU: allocate as needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

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


# The tests that run others in a child process, minutes each, longest first.
RUNNERS = [
    "test_deviceless_runner.py::test_gpu_and_tpu_compile_checks_pass",
    "test_multidevice_runner.py::test_multidevice_tests_pass_on_8_cpu_devices",
    "test_newest_jax_runner.py::test_compiled_checks_pass_with_the_newest_jax",
    "test_deviceless_runner.py::test_sharded_checks_pass_with_jaxlib_0_11",
]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Multi-device tests run only in a process that has 8 devices; the main
    run starts such a process in `test_multidevice_runner.py`. Under
    pytest-xdist the runners start first, on different workers."""
    marked = [item for item in items if item.get_closest_marker("multidevice")]
    if marked and jax.device_count() < 8:
        skip = pytest.mark.skip(
            reason=f"needs 8 devices: run by test_multidevice_runner.py with "
            f"XLA_FLAGS={MULTIDEVICE_FLAG}"
        )
        for item in marked:
            item.add_marker(skip)
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        items[:] = runners_first(items, workers)


def runners_first(items, workers):
    """`items` with the runners at the heads of the first batches that
    pytest-xdist's load scheduling sends its `workers` (each a quarter of
    its share, consecutive): the j-th runner is the (j // workers)-th test
    of worker j % workers' batch, so they start at once, not last on one
    worker."""
    runners = [item for name in RUNNERS for item in items if item.nodeid.endswith(name)]
    order = [item for item in items if item not in runners]
    batch = max(min(len(items) // workers // 4, len(items)), 2)
    places = sorted(
        ((j % workers) * batch + j // workers, item) for j, item in enumerate(runners)
    )
    for place, item in places:
        order.insert(min(place, len(order)), item)
    return order


@pytest.fixture(params=["conditional", "every step"])
def window_form(request, monkeypatch):
    """Runs a test with each form of the drop-in's step: the inner
    optimizer in a conditional, or on every step with its results
    selected (as on GPUs and TPUs). Which one a program gets depends on
    the backend and jaxlib's version
    (`optax_ext/_accumulate/window.drop_in_in_conditional`), so the tests
    that take this fixture check both, whatever runs them. JAX's caches
    are cleared around it: a trace of the other form must not be reused."""
    from optax_ext._accumulate import window

    conditional = request.param == "conditional"
    jax.clear_caches()
    monkeypatch.setattr(window, "drop_in_in_conditional", lambda p: conditional)
    yield request.param
    jax.clear_caches()
