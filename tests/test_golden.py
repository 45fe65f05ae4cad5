"""Golden outputs: today's accumulation, bit for bit.

Each case of `tests/_golden_cases.py` (the drop-in `update`, the fused
`apply_gradients`, `emit=` chosen on the host, `weighted=True`, nested
`MultiSteps`, `skip_when` and `should_skip_update_fn`, `microbatched`, per
device with `axis_name` on 8 CPU devices; float32 and bfloat16 params;
sgd, adamw and lion) is run again and every recorded array (every step's
params, updates and state leaves) must have the recorded bits: a refactor
that means to change no numbers proves it here. Recorded by
`tests/data/golden/make_golden.py`, per JAX and jaxlib version, at the
suite's XLA settings; elsewhere the tests skip, saying why
(docs/contributing.md, "Golden outputs").
"""

import functools
import importlib.metadata
import sys

import _golden_cases as golden
import jax
import numpy as np
import pytest


def _recorded(group: str, name: str) -> dict[str, np.ndarray]:
    return golden.load_case(golden.recording_dir() / f"{group}.npz", name)


@functools.cache
def _inputs() -> dict[str, np.ndarray]:
    return golden.load_inputs()


def _order(key: str):
    """Records in the order the run made them: by step, then by name."""
    step = key.split("/")[1]
    return (-1 if step == "init" else int(step)), key


def _decode(key: str, bits: np.ndarray) -> np.ndarray:
    return bits.view(np.dtype(key.rpartition("|")[2]))


def _check(name: str) -> None:
    reason = golden.skip_reason()
    if reason:
        pytest.skip(reason)
    if jax.default_backend() != "cpu":
        pytest.skip(f"recorded on XLA:CPU, running on {jax.default_backend()}")
    manifest = golden.manifest()
    case = golden.CASES[name]
    assert name in manifest["cases"].get(case.group, []), (
        f"{name} is not in the recording: record it (make_golden.py)"
    )
    want = _recorded(case.group, name)
    got = golden.encode(name, case.run(_inputs()))
    assert sorted(got) == sorted(want), "the records' names or dtypes differ"
    differ = sorted(
        (k for k in want if not np.array_equal(got[k], want[k])), key=_order
    )
    if differ:
        first = differ[0]
        versions = manifest["versions"]
        lines = [
            f"{len(differ)} of {len(want)} records differ from the recording "
            f"at {manifest['commit'][:12]} (optax {versions['optax']} there, "
            f"{importlib.metadata.version('optax')} here); first: {first}",
            f"  recorded: {_decode(first, want[first]).ravel()[:8]}",
            f"  now:      {_decode(first, got[first]).ravel()[:8]}",
            *(f"  {k}" for k in differ[1:6]),
        ]
        pytest.fail("\n".join(lines))


@pytest.mark.parametrize(
    "name", [n for g in golden.groups(multidevice=False).values() for n in g]
)
def test_bits_are_as_recorded(name):
    _check(name)


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "name", [n for g in golden.groups(multidevice=True).values() for n in g]
)
def test_bits_on_8_devices_are_as_recorded(name):
    _check(name)


def test_a_changed_bit_is_found(monkeypatch):
    """The check fails on one flipped bit in one step's record."""
    reason = golden.skip_reason()
    if reason or jax.default_backend() != "cpu":
        pytest.skip(reason or "not XLA:CPU")
    name = "update-sgd-f32"
    recorded = _recorded("dropin", name)
    key = f"{name}/4/state/acc_grads/w|float32"
    flipped = recorded[key].copy()
    flipped.ravel()[3] ^= 1
    monkeypatch.setattr(
        sys.modules[__name__],
        "_recorded",
        lambda group, name: {**recorded, key: flipped},
    )
    with pytest.raises(pytest.fail.Exception, match=r"1 of \d+ records differ"):
        _check(name)
