"""inject_hyperparams' state through real checkpoints: save -> restore ->
continue, with orbax-checkpoint (CheckpointManager, StandardSave and
StandardRestore into an abstract state), equinox serialisation, pickle and
jax.device_get; and checkpoints moved between optax and optax_ext.

The references are independent of optax_ext: an uninterrupted run of the same
jitted step, and plain optax (the bare factory, or optax.inject_hyperparams).
"""

import io
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_close_across_programs, avals, to_np

import optax_ext

ocp = pytest.importorskip("orbax.checkpoint")

SCHEDULE = optax.linear_schedule(1e-1, 1e-2, 6)
STEPS, SAVE_AT = 6, 3
DTYPES = [jnp.float32, jnp.bfloat16]


def _params(dtype):
    return {"w": jnp.linspace(0.5, 1.5, 4).astype(dtype), "b": jnp.zeros(2, dtype)}


def _batch(i, dtype):
    return jnp.linspace(-1.0, 1.0, 4).astype(dtype) * (1 + i)


def _loss(params, x):
    return jnp.sum((params["w"] * x - 1) ** 2) + jnp.sum((params["b"] - x[:2]) ** 2)


def _step_fn(opt, traces):
    """The user's jitted train step; `traces` counts its traces."""

    @jax.jit
    def step(params, state, x):
        traces.append(None)
        grads = jax.grad(_loss)(params, x)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


def _run(step, params, state, steps, dtype):
    all_updates = []
    for i in steps:
        params, state, updates = step(params, state, _batch(i, dtype))
        all_updates.append(updates)
    return params, state, all_updates


def _assert_bits_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        np.testing.assert_array_equal(to_np(a), to_np(b))


def _orbax_round_trip(tmp_path, tree, abstract):
    """Save with StandardSave, restore into `abstract` (ShapeDtypeStructs) as
    orbax's docs show."""
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(SAVE_AT, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        return manager.restore(SAVE_AT, args=ocp.args.StandardRestore(abstract))


def _eqx_round_trip(tmp_path, tree, like):
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, tree)
    return eqx.tree_deserialise_leaves(path, like)


def _pickle_round_trip(tmp_path, tree, like):
    del tmp_path, like
    buffer = io.BytesIO()
    pickle.dump(tree, buffer)
    buffer.seek(0)
    return pickle.load(buffer)


def _device_get_round_trip(tmp_path, tree, like):
    del tmp_path, like
    return jax.device_get(tree)  # numpy arrays: strongly typed


def _abstract(opt, params):
    """What a fresh process builds to restore into: no real state needed."""
    return {
        "params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params),
        "opt_state": jax.eval_shape(opt.init, params),
    }


ROUND_TRIPS = {
    "orbax": _orbax_round_trip,
    "equinox": _eqx_round_trip,
    "pickle": _pickle_round_trip,
    "device_get": _device_get_round_trip,
}


def _like(kind, opt, params):
    if kind == "orbax":
        return _abstract(opt, params)
    return {"params": params, "opt_state": opt.init(params)}


@pytest.mark.parametrize("kind", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "lr", ["schedule", "float", "weak-array"], ids=lambda s: f"lr={s}"
)
def test_save_restore_continue_is_bit_identical_without_retrace(
    tmp_path, kind, dtype, lr
):
    """Issue 13: a restored inject_hyperparams state retraced the train step
    (weak hyperparams came back strong), and after pickle/device_get a state
    built with learning_rate=jnp.asarray(0.1) gave bf16 params float32
    updates. Reference: the same jitted step run without interruption."""
    learning_rate = {"schedule": SCHEDULE, "float": 0.1, "weak-array": None}[lr]
    if learning_rate is None:
        learning_rate = jnp.asarray(0.1)
        assert learning_rate.weak_type
    opt = optax_ext.inject_hyperparams(optax.adamw)(learning_rate, weight_decay=0.1)
    params = _params(dtype)

    traces = []
    step = _step_fn(opt, traces)
    want_params, want_state, want_updates = _run(
        step, params, opt.init(params), range(STEPS), dtype
    )
    assert len(traces) == 1
    for u in want_updates:  # bf16 params -> bf16 updates, as bare adamw gives
        assert avals(u) == avals(params)

    mid_params, mid_state, _ = _run(
        step, params, opt.init(params), range(SAVE_AT), dtype
    )
    restored = ROUND_TRIPS[kind](
        tmp_path,
        {"params": mid_params, "opt_state": mid_state},
        _like(kind, opt, params),
    )
    assert avals(restored["opt_state"]) == avals(mid_state)
    got_params, got_state, got_updates = _run(
        step, restored["params"], restored["opt_state"], range(SAVE_AT, STEPS), dtype
    )
    assert len(traces) == 1, "the train step retraced after the restore"
    _assert_bits_equal(got_params, want_params)
    _assert_bits_equal(got_state, want_state)
    _assert_bits_equal(got_updates, want_updates[SAVE_AT:])

    # A fresh step over a resumed run traces once, not once per state form.
    fresh_traces = []
    _run(
        _step_fn(opt, fresh_traces),
        restored["params"],
        restored["opt_state"],
        range(SAVE_AT, STEPS),
        dtype,
    )
    assert len(fresh_traces) == 1


def _hyperparams_as_python(state):
    return {k: float(jnp.asarray(v, jnp.float32)) for k, v in state.hyperparams.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("direction", ["optax->optax_ext", "optax_ext->optax"])
@pytest.mark.parametrize(
    "factory, kwargs",
    [
        (optax.adam, {"learning_rate": 1e-2}),
        (optax.sgd, {"learning_rate": 0.1, "momentum": 0.9}),
    ],
    ids=["adam", "sgd-momentum"],
)
def test_checkpoints_move_between_optax_and_optax_ext(
    tmp_path, dtype, direction, factory, kwargs
):
    """A state saved by one library restores (orbax, into the other's abstract
    state) and continues in the other with no retrace and the same update
    dtypes. What the continuation equals, exactly:

    - it equals, bit for bit, the target library continuing from its own
      restored copy of the checkpoint whenever the hyperparameter values
      agree; float32 hyperparameters do, both ways (bfloat16 bit for bit on
      XLA:CPU, elsewhere within `assert_close_across_programs`'s bound);
    - optax stores hyperparameters in the params' dtype: from a bfloat16
      optax checkpoint optax_ext restores the bf16-rounded values
      (b2=0.999 -> 1.0) and continues as the bare factory given those values
      (checked against it); optax given an optax_ext bfloat16 checkpoint has
      them rounded to bfloat16 by the restore, as its own init does.
    """
    source_lib, target_lib = (
        (optax, optax_ext) if direction == "optax->optax_ext" else (optax_ext, optax)
    )
    source = source_lib.inject_hyperparams(factory)(**kwargs)
    target = target_lib.inject_hyperparams(factory)(**kwargs)
    params = _params(dtype)
    source_traces, target_traces = [], []
    mid_params, mid_state, _ = _run(
        _step_fn(source, source_traces),
        params,
        source.init(params),
        range(SAVE_AT),
        dtype,
    )
    restored = _orbax_round_trip(
        tmp_path,
        {"params": mid_params, "opt_state": mid_state},
        _abstract(target, params),
    )
    # The restored state has the target's own avals (orbax casts the leaves).
    assert avals(restored["opt_state"]) == [
        (path, shape, dtype_name, False)
        for path, shape, dtype_name, _ in avals(target.init(params))
    ]
    target_step = _step_fn(target, target_traces)
    _run(target_step, params, target.init(params), range(1), dtype)
    got_params, _, got_updates = _run(
        target_step,
        restored["params"],
        restored["opt_state"],
        range(SAVE_AT, STEPS),
        dtype,
    )
    assert len(target_traces) == 1, "restoring the other library's state retraced"
    for u in got_updates:
        assert avals(u) == avals(params)

    # Independent reference: the bare factory with the restored hyperparameter
    # values as Python numbers, from the restored inner state.
    values = _hyperparams_as_python(restored["opt_state"])
    bare = factory(**{**kwargs, **values})
    bare_params, _, bare_updates = _run(
        _step_fn(bare, []),
        restored["params"],
        restored["opt_state"].inner_state,
        range(SAVE_AT, STEPS),
        dtype,
    )
    exact = target_lib is optax_ext or dtype == jnp.float32 or factory is optax.sgd
    if exact and dtype == jnp.float32:
        _assert_bits_equal(got_updates, bare_updates)
        _assert_bits_equal(got_params, bare_params)
    elif exact:
        # bfloat16, injected vs bare: bit for bit on XLA:CPU; elsewhere the
        # two programs are compiled apart: within the bound of the steps run
        # (32 roundings each, with room over adam's 20; one more for params).
        steps = STEPS - SAVE_AT
        for t, (u, w) in enumerate(zip(got_updates, bare_updates, strict=True)):
            assert_close_across_programs(u, w, ops=(t + 1) * 32)
        assert_close_across_programs(got_params, bare_params, ops=steps * 32 + 1)
    if dtype == jnp.float32:
        # float32: the two libraries agree with each other uninterrupted too.
        want_params, _, _ = _run(
            _step_fn(source, []), params, source.init(params), range(STEPS), dtype
        )
        _assert_bits_equal(got_params, want_params)


def test_optax_bf16_checkpoint_holds_rounded_hyperparameters(tmp_path):
    """The documented difference: optax's bfloat16 state holds b2=0.999
    rounded to 1.0 (its first adam update is NaN); optax_ext restores what the
    checkpoint holds and says so in state.hyperparams."""
    params = _params(jnp.bfloat16)
    theirs = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    ours = optax_ext.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    restored = _orbax_round_trip(
        tmp_path,
        {"params": params, "opt_state": theirs.init(params)},
        _abstract(ours, params),
    )
    b2 = restored["opt_state"].hyperparams["b2"]
    assert b2.dtype == jnp.float32 and float(b2) == 1.0
    assert float(ours.init(params).hyperparams["b2"]) == np.float32(0.999)


class _Marker:
    """Compares by identity and prints alike: what a pickle round trip makes
    of an Equinox module's `MISSING` marker for an unset static default."""

    def __repr__(self):
        return "marker"


class _Tagged(eqx.Module):
    w: jax.Array
    tag: _Marker = eqx.field(static=True)

    def __init__(self):
        self.w, self.tag = jnp.ones(2), _Marker()


def test_containers_that_print_alike_but_differ_are_explained():
    """Containers that compare unequal but print alike (a state pickled
    without a target: an Equinox module's static marker comes back as
    another object). The error printed the same `PyTreeDef` twice; it now
    says what differs and how to restore."""
    opt = optax_ext.MultiSteps(optax.sgd(0.1), 2)
    params, state = _Tagged(), opt.init(_Tagged())
    assert jax.tree.structure(state.acc_grads) != jax.tree.structure(params)
    assert str(jax.tree.structure(state.acc_grads)) == str(jax.tree.structure(params))
    with pytest.raises(ValueError, match=r"print alike .* but compare unequal"):
        opt.update(params, state, params)
