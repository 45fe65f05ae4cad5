"""The suite's XLA:CPU compiles run LLVM at -O0 (`conftest.py`), which
takes a sixth off the suite's time on CI's two cores. The tests assert the optimized
HLO, the buffers and the numbers of the programs they compile, so those
must be what XLA's default (-O3) gives: checked here on whole train steps
of every form, on each JAX the suite runs at -O0 (the main run's and the
newest JAX's), and on 8 devices with the params sharded under `jax.jit`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_CPU_FLAG
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from test_train_step_memory import FORMS, INNER, MODELS, train_step

import optax_ext

DEFAULT = {"xla_backend_optimization_level": 3}
FIELDS = (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
)

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the flag is set for XLA:CPU only"
)


def test_the_flag_is_set_where_the_suite_compiles(tmp_path):
    """Unless OPTAX_EXT_XLA_DEFAULTS asks for XLA's defaults, this process
    compiles at -O0, as the compile's own debug options say: so the
    comparisons below compare two levels."""
    if os.environ.get("OPTAX_EXT_XLA_DEFAULTS"):
        pytest.skip("OPTAX_EXT_XLA_DEFAULTS: this run compiles with XLA's defaults")
    flags = os.environ.get("XLA_FLAGS", "")
    if FAST_CPU_FLAG not in flags and FAST_CPU_FLAG.split("=")[0] in flags:
        pytest.skip(f"XLA_FLAGS chooses the level: {flags}")
    assert FAST_CPU_FLAG in flags
    lowered = jax.jit(lambda x: 2 * x).lower(jnp.ones(3))
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    (options,) = tmp_path.glob("*debug_options*")
    assert "xla_backend_optimization_level: 0" in options.read_text()


def _opt(form, tx):
    if form == "bare":
        return tx
    if form == "optax":
        return optax.MultiSteps(tx, 4)
    return optax_ext.MultiSteps(tx, 4)


def _same_program(lowered, args):
    """The process's compile of `lowered` against XLA's default level:
    the same optimized HLO, the same buffer sizes, the same results (each
    run on its own copy of the donated arguments)."""
    ours, default = lowered.compile(), lowered.compile(compiler_options=DEFAULT)
    assert ours.as_text() == default.as_text()
    ours_mem, default_mem = ours.memory_analysis(), default.memory_analysis()
    for field in FIELDS:
        assert getattr(ours_mem, field) == getattr(default_mem, field), field
    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
    got, want = ours(*copy(args)), default(*copy(args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Every form on the MLP; then the inner optimizers and the model whose
# programs differ most (a reduction, bfloat16, attention).
CASES = [
    *(("mlp", "adamw", "float32", form) for form in ("bare", "optax", *FORMS)),
    ("mlp", "lion", "bfloat16", "drop-in"),
    ("mlp", "lion", "bfloat16", "fused"),
    ("mlp", "clip+adamw", "float32", "optax"),
    ("mlp", "clip+adamw", "float32", "emit=False"),
    ("gpt2-like", "adamw", "float32", "drop-in"),
]


@pytest.mark.parametrize("model,inner,dtype,form", CASES)
def test_fast_cpu_compile_is_the_default_program(model, inner, dtype, form):
    params, loss, batch = MODELS[model](jnp.dtype(dtype))
    opt = _opt(form, INNER[inner][0]())
    state = opt.init(params)
    step = jax.jit(train_step(opt, form, loss, []), donate_argnums=(0, 1))
    _same_program(step.lower(params, state, batch), (params, state, batch))


@pytest.mark.multidevice
@pytest.mark.parametrize("form", ["optax", "drop-in", "fused"])
def test_fast_cpu_compile_is_the_default_program_sharded(form):
    """FSDP on 8 devices: params, state and batch split on their first
    axis under `jax.jit` (an `Auto` mesh axis)."""
    params, loss, batch = MODELS["mlp"](jnp.float32)
    opt = _opt(form, optax.adamw(1e-3))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

    def place(a):
        split = a.ndim and a.shape[0] % 8 == 0
        spec = PartitionSpec("x") if split else PartitionSpec()
        return jax.device_put(a, NamedSharding(mesh, spec))

    params, batch = jax.tree.map(place, (params, batch))
    state = jax.tree.map(place, opt.init(params))
    step = jax.jit(train_step(opt, form, loss, []), donate_argnums=(0, 1))
    _same_program(step.lower(params, state, batch), (params, state, batch))
