"""Extra keyword arguments (`skip=`, `value=`) reach every nested optimizer
in `update`, as they do in `apply_gradients`: for every nesting up to depth
3 of `MultiSteps`, `skip_when` and `optax.chain`, the two forms give the
params of plain optax (`optax.MultiSteps` and a `skip_when` written here),
bit for bit. The values are dyadic and few-bit (windows of 2, a learning
rate of 1/8, a plateau factor of 1/2), so every operation is exact and
the comparison needs no tolerance."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_ext

STEPS = 16
# Skipped steps: mixed at each level of nesting of windows of 2 (the emitting
# steps of depth 1 are the odd ones, of depth 2 3, 7, 11, 15, of depth 3 7, 15).
SKIP = np.isin(np.arange(STEPS), [1, 6, 7, 11, 12])
# A loss with plateaus, so that reduce_on_plateau halves the scale.
VALUE = np.asarray([4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0], np.float32)
GRADS = {
    "w": ((np.arange(STEPS)[:, None] + np.arange(3)) % 5 - 2).astype(np.float32) / 4,
    "b": (np.arange(STEPS) % 3 - 1).astype(np.float32) / 2,
}
PARAMS = {"w": np.asarray([1.0, -2.0, 0.5], np.float32), "b": np.float32(0.25)}


def _base(name):
    if name == "sgd":
        return optax.sgd(0.125)
    plateau = optax.contrib.reduce_on_plateau(
        factor=0.5, patience=1, rtol=0.0, atol=0.5, cooldown=0
    )
    return optax.chain(optax.sgd(0.125), plateau)


def _reference_skip_when(inner):
    """skip_when in plain optax: `skip=True` gives zero updates and leaves
    the inner state; the flag goes no further."""
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra_args):
        skip = extra_args.pop("skip", False)
        new_updates, new_state = inner.update(updates, state, params, **extra_args)
        new_updates = jax.tree.map(
            lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates
        )
        new_state = jax.tree.map(lambda n, o: jnp.where(skip, o, n), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _build(nesting, base, ours):
    """The optimizer `nesting` (outermost first) around `base`, with this
    package's wrappers or plain optax's. A `MultiSteps` inside a chain is
    its `gradient_transformation()`, as optax documents (a chain hides the
    extra arguments from anything else). optax's MultiSteps is called
    through its own `update`, which forwards them."""
    opt = _base(base)
    skip_when = optax_ext.skip_when if ours else _reference_skip_when
    for name, arg in reversed(nesting):
        if name == "MultiSteps" and ours:
            opt = optax_ext.MultiSteps(opt, arg)
        elif name == "MultiSteps":
            # optax's `gradient_transformation()` drops extra arguments.
            opt = optax.MultiSteps(opt, arg)
            opt = optax.GradientTransformationExtraArgs(opt.init, opt.update)
        elif name == "skip_when":
            opt = skip_when(opt)
        else:
            if isinstance(opt, optax_ext.MultiSteps):
                opt = opt.gradient_transformation()
            opt = optax.chain(optax.clip(8.0), opt)
    return opt


def _run(opt, fused):
    """The params after each step of a jitted loop over the steps."""

    def step(carry, xs):
        params, state = carry
        grads, skip, value = xs
        if fused:
            params, state = optax_ext.apply_gradients(
                opt, grads, state, params, skip=skip, value=value
            )
        else:
            updates, state = opt.update(grads, state, params, skip=skip, value=value)
            params = optax.apply_updates(params, updates)
        return (params, state), params

    @jax.jit
    def run(params):
        _, trajectory = jax.lax.scan(step, (params, opt.init(params)), xs)
        return trajectory

    xs = (GRADS, jnp.asarray(SKIP), jnp.asarray(VALUE))
    return jax.tree.map(np.asarray, run(PARAMS))


WRAPPERS = [("MultiSteps", 2), ("skip_when", None), ("chain", None)]
NESTINGS = [
    nesting
    for depth in range(4)
    for nesting in itertools.product(WRAPPERS, repeat=depth)
]
# The cases of issue 26: skip_when(MultiSteps2(plateau)) is among the
# nestings, and MultiSteps1(MultiSteps2(skip_when(sgd))) (its `update` moved
# the params on skipped steps).
CASES = [(nesting, "plateau") for nesting in NESTINGS] + [
    ((("MultiSteps", 1), ("MultiSteps", 2), ("skip_when", None)), "sgd"),
]


def _name(case):
    nesting, base = case
    parts = [name if arg is None else f"{name}{arg}" for name, arg in nesting]
    return "(".join(parts + [base]) + ")" * len(parts)


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_update_and_apply_gradients_forward_extra_args_at_any_depth(case):
    nesting, base = case
    expected = _run(_build(nesting, base, ours=False), fused=False)
    opt = _build(nesting, base, ours=True)
    for fused in (False, True):
        got = _run(opt, fused)
        for name in PARAMS:
            np.testing.assert_array_equal(
                got[name], expected[name], err_msg=f"{name}, fused={fused}"
            )
