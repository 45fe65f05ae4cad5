import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

# Each hypothesis example compiles JAX code: keep examples few and untimed.
hypothesis.settings.register_profile(
    "optax_ext", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile("optax_ext")

import pytest  # noqa: E402

MULTIDEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def pytest_collection_modifyitems(config, items):
    """Multi-device tests run only in a process that has 8 devices; the main
    run starts such a process in `test_multidevice_runner.py`."""
    marked = [item for item in items if item.get_closest_marker("multidevice")]
    if not marked:
        return
    import jax

    if jax.device_count() >= 8:
        return
    skip = pytest.mark.skip(
        reason=f"needs 8 devices: run by test_multidevice_runner.py with "
        f"XLA_FLAGS={MULTIDEVICE_FLAG}"
    )
    for item in marked:
        item.add_marker(skip)
