"""What injecting does to the arithmetic, exactly (docs/inject_hyperparams.md,
"Numerics"): an injected hyperparameter is its value rounded to the dtype it
is stored in (float32; float64 under x64), handed to the factory weakly typed.
So the updates are, bit for bit on XLA:CPU, those of the bare factory given
the rounded numbers (elsewhere XLA compiles the two programs differently:
bfloat16 within `_helpers.assert_close_across_programs`'s bound); they
differ from the bare factory given the unrounded Python numbers only where
the factory combines hyperparameters in Python arithmetic (in float64), as
adam's `1 - b2`."""

import inspect

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    across_programs_exact,
    assert_close_across_programs,
    cross_program_tolerance,
    to_np,
)
from hypothesis import given, settings

import optax_ext

FACTORIES = {
    "adam": (optax.adam, {"learning_rate": 1e-2}),
    "adamw": (optax.adamw, {"learning_rate": 1e-2}),
    "sgd-momentum": (optax.sgd, {"learning_rate": 0.1, "momentum": 0.9}),
    "rmsprop": (optax.rmsprop, {"learning_rate": 1e-2}),
    "lion": (optax.lion, {"learning_rate": 1e-3}),
    "adagrad": (optax.adagrad, {"learning_rate": 1e-2}),
    "nadam": (optax.nadam, {"learning_rate": 1e-2}),
    "lamb": (optax.lamb, {"learning_rate": 1e-2}),
}


def _python_floats(factory, kwargs):
    """Every float argument the factory is called with, defaults included."""
    out = {}
    for name, param in inspect.signature(factory).parameters.items():
        value = kwargs.get(name, param.default)
        if type(value) is float:
            out[name] = value
    return out


def _rounded(factory, kwargs, dtype=np.float32):
    """The bare factory given each float rounded to `dtype`, as Python floats."""
    floats = _python_floats(factory, kwargs)
    return factory(**{**kwargs, **{k: float(dtype(v)) for k, v in floats.items()}})


def _run(opt, params, steps, seed=0):
    state = opt.init(params)
    update = jax.jit(opt.update)
    key, outs = jax.random.key(seed), []
    for _ in range(steps):
        key, sub = jax.random.split(key)
        grads = jax.tree.map(
            lambda p, sub=sub: jax.random.normal(sub, p.shape).astype(p.dtype),
            params,
        )
        updates, state = update(grads, state, params)
        outs.append(updates)
    return outs


def _params(dtype):
    return {"w": jnp.linspace(-1, 1, 64).astype(dtype), "b": jnp.zeros(3, dtype)}


# Rounding steps on the path to one entry of one step's updates (each
# elementwise op once; a norm over a 64-entry leaf 63): adam's moments, bias
# corrections, sqrt, eps, division and learning rate are about 20; lamb adds
# the norms of the params and of the update over the leaf; lion takes a sign,
# which flips when its argument is within a rounding of 0 (a swing of twice
# the update: 2 / eps(bfloat16) = 256).
OPS_PER_STEP = {"lamb": 32 + 2 * 63, "lion": 256}


def _max_ulps(got, want):
    worst = 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        if a.dtype == jnp.float16:
            ia, ib = (np.asarray(x).view(np.int16).astype(np.int64) for x in (a, b))
        elif a.dtype == jnp.bfloat16:  # bfloat16 is the top 16 bits of float32
            ia, ib = (to_np(x).view(np.int32).astype(np.int64) >> 16 for x in (a, b))
        else:
            ia, ib = (np.asarray(x).view(np.int32).astype(np.int64) for x in (a, b))
        worst = max(worst, int(np.abs(ia - ib).max(initial=0)))
    return worst


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("name", FACTORIES)
def test_equals_bare_factory_given_float32_hyperparameters(name, dtype):
    """0 ulps over 10 jitted steps: float32 on every backend (measured on an
    H200 too); bfloat16 on XLA:CPU, and elsewhere within the bound of
    `assert_close_across_programs` for step t's `t * OPS_PER_STEP` roundings."""
    factory, kwargs = FACTORIES[name]
    params = _params(dtype)
    injected = _run(optax_ext.inject_hyperparams(factory)(**kwargs), params, 10)
    bare = _run(_rounded(factory, kwargs), params, 10)
    if dtype == jnp.float32:
        assert max(_max_ulps(a, b) for a, b in zip(injected, bare, strict=True)) == 0
    for t, (a, b) in enumerate(zip(injected, bare, strict=True), start=1):
        assert_close_across_programs(
            a, b, ops=t * OPS_PER_STEP.get(name, 32), err_msg=f"step {t}"
        )


def test_x64_equals_bare_factory_exactly():
    """Under x64 hyperparameters are stored in float64, which holds the Python
    float exactly: the updates are the bare factory's, bit for bit."""
    with jax.enable_x64(True):
        for name in ["adam", "nadam", "rmsprop"]:
            factory, kwargs = FACTORIES[name]
            params = _params(jnp.float64)
            state = optax_ext.inject_hyperparams(factory)(**kwargs).init(params)
            assert state.hyperparams["learning_rate"].dtype == jnp.float64
            injected = _run(optax_ext.inject_hyperparams(factory)(**kwargs), params, 10)
            bare = _run(factory(**kwargs), params, 10)
            for a, b in zip(
                jax.tree.leaves(injected), jax.tree.leaves(bare), strict=True
            ):
                assert a.dtype == b.dtype == jnp.float64
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float32_difference_from_unrounded_bare_is_the_documented_one():
    """The measurement docs/inject_hyperparams.md quotes: against adam given
    the Python floats (1 - 0.999 computed in float64), float32 updates differ
    by up to 1.2e-4 relative per entry over 50 steps; bfloat16 ones not at all;
    with b1, b2, eps named in static_args (kept Python floats) not at all.
    That is XLA:CPU's; other backends may add the rounding difference of two
    programs compiled apart (`assert_close_across_programs`)."""
    factory, kwargs = FACTORIES["adam"]

    def max_relative(opt, dtype):
        params = _params(dtype)
        got, want = _run(opt, params, 50), _run(factory(**kwargs), params, 50)
        worst = 0.0
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            a, b = to_np(a).astype(np.float64), to_np(b).astype(np.float64)
            nonzero = b != 0
            worst = max(
                worst, float(np.max(np.abs(a - b)[nonzero] / np.abs(b[nonzero])))
            )
        return worst

    injected = optax_ext.inject_hyperparams(factory)(**kwargs)
    static = optax_ext.inject_hyperparams(factory, static_args=("b1", "b2", "eps"))
    if across_programs_exact():
        float32 = max_relative(injected, jnp.float32)
        assert 0 < float32 <= 1.2e-4
        assert max_relative(injected, jnp.bfloat16) == 0
        assert max_relative(static(**kwargs), jnp.float32) == 0
        return
    # Other backends compile the injected and the bare programs differently
    # (2.0e-4 measured on an H200): the documented 1.2e-4 of each entry plus
    # the rounding bound of 50 steps of 32 roundings at the leaf's magnitude.
    ops = 50 * OPS_PER_STEP.get("adam", 32)
    params = _params(jnp.float32)
    got, want = _run(injected, params, 50), _run(factory(**kwargs), params, 50)
    moved = False
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        err = np.abs(to_np(a).astype(np.float64) - to_np(b).astype(np.float64))
        bound = 1.2e-4 * np.abs(to_np(b)) + cross_program_tolerance(b, ops=ops)
        assert (err <= bound).all(), np.max(err / bound)
        moved |= bool((err > 0).any())
    assert moved
    for dtype, opt in [(jnp.bfloat16, injected), (jnp.float32, static(**kwargs))]:
        params = _params(dtype)
        got, want = _run(opt, params, 50), _run(factory(**kwargs), params, 50)
        assert_close_across_programs(got, want, ops=ops, err_msg=str(dtype))


# -- property tests against a float64 numpy reference -----------------------


def _reference(name, lr, b1, b2, grads, dtype):
    """sgd with momentum and adam in float64 numpy, hyperparameters rounded
    to their storage dtype first (float32; float64 under x64)."""
    store = np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32
    lr, b1, b2, eps = (float(store(x)) for x in (lr, b1, b2, 1e-8))
    mu = nu = 0.0
    outs = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.complex128 if np.iscomplexobj(g) else np.float64)
        if name == "sgd-momentum":
            mu = g + b1 * mu
            outs.append(-lr * mu)
        else:
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * np.abs(g) ** 2 + b2 * nu
            mu_hat = mu / (1 - float(store(b1)) ** t)
            nu_hat = nu / (1 - float(store(b2)) ** t)
            outs.append(-lr * mu_hat / (np.sqrt(nu_hat) + eps))
    return outs


DTYPES = ["float16", "bfloat16", "float32", "complex64", "float64"]
# bfloat16 and float16 by ulps of the dtype (each elementwise op rounds once);
# float32 and complex64 at rtol 1e-6 against float64; float64 at 1e-13.
ULPS = {"float16": 4, "bfloat16": 4}
RTOL = {"float32": 1e-6, "complex64": 1e-6, "float64": 1e-13}


@settings(max_examples=15)
@given(
    name=st.sampled_from(["sgd-momentum", "adam"]),
    dtype=st.sampled_from(DTYPES),
    lr=st.floats(1e-4, 1.0),
    b1=st.sampled_from([0.5, 0.9, 0.95]),
    # Adam's bias correction 1 - b2**t is computed in the params' precision;
    # its condition number 1 / (1 - b2**t) amplifies the rounding of b2**t
    # (3e-5 relative for b2=0.999 at t=2 in float32, in bare optax too). With
    # b2 <= 0.9 it stays below 1e-6, so rtol 1e-6 still sees a one-ulp drift.
    b2=st.sampled_from([0.5, 0.75, 0.9]),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    python_scalar=st.booleans(),
)
def test_property_against_float64_reference(
    name, dtype, lr, b1, b2, steps, seed, python_scalar
):
    """Updates of injected sgd-momentum and adam against a float64 reference
    computed by hand, for every floating dtype (float64 under x64), with a
    Python float leaf in the params."""
    rng = np.random.default_rng(seed)
    x64 = dtype == "float64"
    with jax.enable_x64(x64):
        jdtype = jnp.dtype(dtype)
        shape = (5,)
        # Gradients of one sign per entry: no cancellation in the moments, so
        # a relative tolerance measures rounding, not conditioning.
        signs = rng.choice([-1.0, 1.0], size=shape)
        grads = [signs * rng.uniform(0.5, 2.0, size=shape) for _ in range(steps)]
        if dtype == "complex64":
            grads = [g + 1j * g[::-1] for g in grads]
        # rounded to the dtype by JAX, widened by numpy (JAX without x64
        # has no float64 to widen to)
        wide = np.complex128 if dtype == "complex64" else np.float64
        grads = [np.asarray(jnp.asarray(g, jdtype)).astype(wide) for g in grads]
        if name == "sgd-momentum":
            opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=b1)
        else:
            opt = optax_ext.inject_hyperparams(optax.adam)(
                learning_rate=lr, b1=b1, b2=b2
            )
        params = {"w": jnp.zeros(shape, jdtype)}
        if python_scalar:
            params["s"] = 0.5
        state = opt.init(params)
        update = jax.jit(opt.update)
        want = _reference(name, lr, b1, b2, grads, dtype)
        want_s = _reference(name, lr, b1, b2, [np.float64(1.0)] * steps, "float32")
        for t, g in enumerate(grads):
            tree = {"w": jnp.asarray(g, jdtype)}
            if python_scalar:
                tree["s"] = 1.0
            updates, state = update(tree, state, params)
            got = updates["w"]
            assert got.dtype == jdtype
            if dtype in ULPS:
                ref = jnp.asarray(want[t], jdtype)  # the reference rounded once
                assert _max_ulps(got, ref) <= ULPS[dtype], (got, want[t])
            else:
                np.testing.assert_allclose(np.asarray(got), want[t], rtol=RTOL[dtype])
            if python_scalar:
                np.testing.assert_allclose(float(updates["s"]), want_s[t], rtol=1e-6)
