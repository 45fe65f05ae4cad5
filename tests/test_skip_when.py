"""skip_when: skip the inner optimizer on steps decided by a traced flag."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_exact_zeros, avals, to_np

import optax_ext

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


def _params(dtype=jnp.float32):
    return {"w": jnp.ones((3, 2), dtype), "b": jnp.zeros(2, dtype)}


def _grads(params, scale):
    return jax.tree.map(lambda p: jnp.full_like(p, scale), params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_skipped_steps_leave_the_state_and_return_zeros(dtype):
    """The reference is the bare inner optimizer run on the unskipped steps."""
    params = _params(dtype)
    inner = optax_ext.inject_hyperparams(optax.adam)(SCHEDULE)
    opt = optax.chain(optax_ext.zero_nans(), optax_ext.skip_when(inner))
    bare = optax.chain(optax_ext.zero_nans(), inner)
    state, ref_state = opt.init(params), bare.init(params)
    traces = []

    @jax.jit
    def step(grads, state, skip):
        traces.append(None)
        return opt.update(grads, state, params, skip=skip)

    for i, skip in enumerate([False, True, True, False, True, False]):
        grads = _grads(params, 0.1 * (i + 1))
        updates, new_state = step(grads, state, jnp.asarray(skip))
        assert avals(new_state) == avals(state)
        if skip:
            assert_exact_zeros(updates)
            for a, b in zip(
                jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True
            ):
                np.testing.assert_array_equal(to_np(a), to_np(b))
        else:
            want, ref_state = bare.update(grads, ref_state, params)
            for a, b in zip(
                jax.tree.leaves(updates), jax.tree.leaves(want), strict=True
            ):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(to_np(a), to_np(b))
        state = new_state
    assert len(traces) == 1


def test_upstream_conditionally_mask_fails_where_dtypes_differ():
    """bfloat16 params, float32 gradients: optax's counterpart fails in its
    cond; skip_when gives the same avals on skipped and applied steps and keeps
    the state's."""
    params = _params(jnp.bfloat16)
    grads = _grads(_params(jnp.float32), 0.1)
    ours = optax_ext.skip_when(optax.adam(1e-2))
    state = ours.init(params)
    outs = [
        ours.update(grads, state, params, skip=jnp.asarray(skip))
        for skip in (True, False)
    ]
    assert avals(outs[0][0]) == avals(outs[1][0])
    assert avals(outs[0][1]) == avals(outs[1][1]) == avals(state)
    theirs = optax.transforms.conditionally_mask(
        optax.adam(1e-2), lambda step, skip: ~skip, forward_extra_args=True
    )
    with pytest.raises(TypeError, match="cond branches must have equal output types"):
        theirs.update(grads, theirs.init(params), params, skip=jnp.asarray(True))


def test_flag_is_checked():
    opt = optax_ext.skip_when(optax.sgd(1.0), flag="freeze")
    state = opt.init(jnp.zeros(2))
    with pytest.raises(TypeError, match="freeze"):
        opt.update(jnp.ones(2), state)
    with pytest.raises(TypeError, match="scalar bool"):
        opt.update(jnp.ones(2), state, freeze=jnp.zeros(2, bool))
    with pytest.raises(TypeError, match="scalar bool"):
        opt.update(jnp.ones(2), state, freeze=1)
    with pytest.raises(ValueError, match="flag"):
        optax_ext.skip_when(optax.sgd(1.0), flag="not a name")


def test_other_extra_args_reach_the_inner_optimizer():
    def update(updates, state, params=None, *, value):
        return jax.tree.map(lambda u: u * value, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    opt = optax_ext.skip_when(inner)
    u, _ = opt.update(jnp.ones(2), opt.init(jnp.zeros(2)), skip=False, value=3.0)
    np.testing.assert_array_equal(u, [3.0, 3.0])
