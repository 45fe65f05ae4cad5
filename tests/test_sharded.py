"""MultiSteps with params sharded under plain `jax.jit` (FSDP / ZeRO-3 style,
tensor-parallel, and mixes with replicated leaves), on `Auto` and
`Explicit` mesh axes: the train step keeps the accumulator, the inner state
and the params in their donated buffers, as on one device, and its values
are optax.MultiSteps'.

These tests need 8 devices (`multidevice` marker; `test_multidevice_runner.py`
runs them). The compiled memory and copy counts are XLA:CPU's (other
backends schedule and assign buffers their own way): those tests skip
elsewhere.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import collectives_by_step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

pytestmark = pytest.mark.multidevice

K = 3
CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="compiled memory and copies are asserted as XLA:CPU assigns them",
)

# name: (mesh shape, axis names, [(leaf shape, spec)])
LAYOUTS = {
    # A param axis split over the data axis: FSDP / ZeRO-3.
    "fsdp": ((8,), ("fsdp",), [((1024, 256), P("fsdp", None))] * 4),
    # Split over another axis than the data one: tensor-parallel.
    "tensor_parallel": (
        (2, 4),
        ("data", "model"),
        [((512, 512), P(None, "model"))] * 4,
    ),
    # Both, replicated leaves and small ones beside them.
    "mixed": (
        (2, 4),
        ("data", "model"),
        [
            ((1024, 256), P("data", "model")),
            ((512, 256), P()),
            ((1024, 128), P("model")),
            ((256, 1024), P(None, "data")),
            ((300,), P()),
            ((), P()),
        ],
    ),
}

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)
# name: (optax_ext optimizer, the optax.MultiSteps it equals)
OPTIMIZERS = {
    "adam": (
        lambda: optax_ext.MultiSteps(optax.adam(1e-2), K),
        lambda: optax.MultiSteps(optax.adam(1e-2), K),
    ),
    # Lion's updates read its old `mu`: a state leaf ordered after them.
    "lion": (
        lambda: optax_ext.MultiSteps(optax.lion(1e-3), K),
        lambda: optax.MultiSteps(optax.lion(1e-3), K),
    ),
    # No inner state: only the accumulator's clear is ordered.
    "sgd": (
        lambda: optax_ext.MultiSteps(optax.sgd(1e-2), K),
        lambda: optax.MultiSteps(optax.sgd(1e-2), K),
    ),
    "multi_steps_of_skip_when": (
        lambda: optax_ext.MultiSteps(optax_ext.skip_when(optax.adam(1e-2)), K),
        lambda: optax.MultiSteps(optax.adam(1e-2), K),
    ),
    # skip_when called without a flag: a constant predicate around MultiSteps.
    "skip_when_of_multi_steps": (
        lambda: optax_ext.skip_when(optax_ext.MultiSteps(optax.adam(1e-2), K)),
        lambda: optax.MultiSteps(optax.adam(1e-2), K),
    ),
    "multi_steps_of_inject_hyperparams": (
        lambda: optax_ext.MultiSteps(
            optax_ext.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE), K
        ),
        lambda: optax.MultiSteps(
            optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE), K
        ),
    ),
}
CASES = [("fsdp", name) for name in OPTIMIZERS] + [
    (layout, name)
    for layout in ("tensor_parallel", "mixed")
    for name in ("adam", "lion")
]
FORMS = ["update", "apply_gradients"]


def _setup(layout, mode, seed=0):
    """The mesh and params of `layout`, each leaf put with its spec."""
    shape, names, leaves = LAYOUTS[layout]
    mesh = jax.make_mesh(
        shape, names, axis_types=(getattr(AxisType, mode),) * len(names)
    )
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = {
        f"p{i}": jax.device_put(
            jax.random.normal(key, leaf_shape), NamedSharding(mesh, spec)
        )
        for i, (key, (leaf_shape, spec)) in enumerate(zip(keys, leaves, strict=True))
    }
    return mesh, params


def _train_step(opt, form):
    def step(params, state, grads):
        if form == "apply_gradients":
            return optax_ext.apply_gradients(opt, grads, state, params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _compile(opt, form, mesh, params):
    """The donated train step compiled for `params`, and the initial state."""
    with jax.set_mesh(mesh):
        state = jax.jit(opt.init)(params)
        step = jax.jit(_train_step(opt, form), donate_argnums=(0, 1))
        return step.lower(params, state, params).compile(), state


def _per_device_bytes(params):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))


def _large_copies(hlo, min_elements=4096):
    """Copies of arrays of at least `min_elements` (the smallest params
    shard here has 16,384): what XLA adds where a buffer cannot be reused."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\S* copy\(", line)
        if m and np.prod([int(d) for d in m.group(1).split(",")]) >= min_elements:
            found.append(line.strip()[:120])
    return found


@CPU_ONLY
@pytest.mark.parametrize("mode", ["Auto", "Explicit"])
@pytest.mark.parametrize(("layout", "name"), CASES)
def test_sharded_step_keeps_buffers_in_place(layout, name, mode):
    """With params sharded under `jax.jit`, the donated train step needs the
    single-device design's temporary memory per device: the fused form
    almost nothing (under 0.1x the params per device: the conditionals'
    buffer tables), the drop-in form its zero updates (1.0x, 1.01x with
    the tables), and
    XLA copies no params-sized array. A mini-step runs no collective; an
    emitting step adds only all-reduces of one element (the ordering
    tokens' reads of a sharded array's element). Before the tokens were
    built for sharded arrays: drop-in 2.0x and fused 1.0x, with a copy of
    every accumulator leaf."""
    mesh, params = _setup(layout, mode)
    per_device = _per_device_bytes(params)
    temp = {}
    for form in FORMS:
        compiled, _ = _compile(OPTIMIZERS[name][0](), form, mesh, params)
        temp[form] = compiled.memory_analysis().temp_size_in_bytes
        hlo = compiled.as_text()
        assert _large_copies(hlo) == [], form
        mini, emitting = collectives_by_step(hlo)
        assert mini == [], form
        for shape, op in emitting:
            dims = re.search(r"\[([\d,]*)\]", shape).group(1)
            elements = np.prod([int(d) for d in dims.split(",") if d])
            assert op == "all-reduce" and elements == 1, (form, shape, op)
    fused, drop_in = temp["apply_gradients"], temp["update"]
    assert fused <= 0.1 * per_device, fused / per_device
    # The zero updates, and a few hundred bytes of tables (under 1%).
    assert drop_in <= 1.01 * per_device, (drop_in / per_device, fused / per_device)


def _grads(params, step):
    """Gradients for `step`, sharded as the params are."""
    return jax.tree.map(
        lambda p: jax.device_put(
            jnp.sin(p * (step + 1) + step).astype(p.dtype), p.sharding
        ),
        params,
    )


@pytest.mark.parametrize("mode", ["Auto", "Explicit"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("layout", "name"), CASES)
def test_sharded_step_equals_optax_multisteps(layout, name, form, mode):
    """Two windows and a mini-step of the sharded, donated train step give
    the params of optax.MultiSteps' drop-in train step, jitted alike, at
    every step; the params keep their shardings."""
    ours, theirs = OPTIMIZERS[name]
    mesh, params = _setup(layout, mode)
    shardings = jax.tree.map(lambda p: p.sharding, params)
    ref_params = jax.tree.map(jnp.copy, params)
    with jax.set_mesh(mesh):
        opt, ref = ours(), theirs()
        state, ref_state = jax.jit(opt.init)(params), jax.jit(ref.init)(ref_params)
        step = jax.jit(_train_step(opt, form), donate_argnums=(0, 1))
        ref_step = jax.jit(_train_step(ref, "update"), donate_argnums=(0, 1))
        for i in range(2 * K + 1):
            grads = _grads(ref_params, i)
            params, state = step(params, state, grads)
            ref_params, ref_state = ref_step(ref_params, ref_state, grads)
            for key in params:
                np.testing.assert_allclose(
                    np.asarray(params[key]),
                    np.asarray(ref_params[key]),
                    rtol=1e-6,
                    atol=1e-7,
                    err_msg=f"{key} after step {i}",
                )
    for key, p in params.items():
        assert p.sharding.is_equivalent_to(shardings[key], p.ndim), key
