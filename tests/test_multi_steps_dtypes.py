"""MultiSteps: the accumulation dtype rule, Python-scalar and integer leaves
(issue 13), against independent references: numpy float64 means of the
window's gradients, and plain optax on hand-averaged gradients.

The rule (see `MultiSteps`' docstring): the accumulator of a params leaf has
the least dtype holding both the leaf's dtype and `accumulator_dtype` (the
leaf's own with `None`), fixed at init; a gradient whose dtype it does not
hold is refused with an error naming `accumulator_dtype`, the leaf's path and
both dtypes; float16 and bfloat16 accumulators are updated in float32.

`sgd(1)` emits exactly minus the accumulated mean (negation is exact), so
its updates measure the accumulation itself.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import to_np
from hypothesis import example, given, settings

import optax_ext

# --- the cases of issue 13, each failing before ------------------------------


def test_complex_gradients_with_float32_params_are_refused():
    """Issue 13: the imaginary part was dropped (K=1: -1+0j where optax gives
    -1-2j)."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=1)
    state = opt.init({"w": jnp.zeros(1)})
    with pytest.raises(
        TypeError,
        match=r"\['w'\] has dtype complex64.*acc_grads\['w'\]\) has dtype float32"
        r".*accumulator_dtype=float32.*accumulator_dtype=jnp.complex64",
    ):
        opt.update({"w": jnp.array([1 + 2j], jnp.complex64)}, state)


@pytest.mark.filterwarnings("ignore:Casting from complex to real:DeprecationWarning")
@pytest.mark.parametrize("k", [1, 3])
def test_complex_gradients_with_complex_accumulator_keep_the_imaginary_part(k):
    grads = [jnp.array([1 + 2j, -3 + 0.5j], jnp.complex64) * (i + 1) for i in range(k)]
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=k, accumulator_dtype=jnp.complex64
    )
    state = opt.init(jnp.zeros(2))
    assert state.acc_grads.dtype == jnp.complex64
    for g in grads:
        u, state = opt.update(g, state)
    want = -np.mean([np.asarray(g, np.complex128) for g in grads], axis=0)
    np.testing.assert_allclose(np.asarray(u), want, rtol=1e-7)
    if k == 1:
        theirs = optax.MultiSteps(optax.sgd(1.0), 1)
        u_theirs, _ = theirs.update(grads[0], theirs.init(jnp.zeros(2)))
        np.testing.assert_array_equal(np.asarray(u), np.asarray(u_theirs))


def test_complex_params_accumulate_in_complex64_by_default():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    state = opt.init(jnp.zeros(1, jnp.complex64))
    assert state.acc_grads.dtype == jnp.complex64
    _, state = opt.update(jnp.array([1 + 2j], jnp.complex64), state)
    u, _ = opt.update(jnp.array([3 - 2j], jnp.complex64), state)
    np.testing.assert_array_equal(np.asarray(u), [-2 + 0j])


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("jit", [False, True])
def test_bfloat16_gradients_into_a_complex64_accumulator(jit):
    """bfloat16 gradients are rounded as bfloat16 before they are widened
    (`_accumulation.widen`), and widened to any accumulator: here complex64, where
    the rounding must not be applied to the complex value (XLA has no
    complex `reduce_precision`). The window's mean goes back to the real
    gradients' dtype by its real part, not by a complex-to-real cast (which
    JAX deprecates: an error here)."""
    grads = [
        jnp.array([1.5, 2.25, -3.0, 0.1], jnp.bfloat16) * (i + 1) for i in range(2)
    ]
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=2, accumulator_dtype=jnp.complex64
    )
    params = jnp.zeros(4, jnp.bfloat16)
    state = opt.init(params)
    assert state.acc_grads.dtype == jnp.complex64
    update = jax.jit(opt.update) if jit else opt.update
    for g in grads:
        u, state = update(g, state, params)
    # the mean of the bfloat16 values, in float64, rounded once to bfloat16
    want = -np.mean([np.asarray(g, np.float64) for g in grads], axis=0)
    assert u.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(u, np.float32),
        np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32),
    )


def test_float32_gradients_into_bfloat16_accumulator_are_refused():
    """Issue 13: with bf16 params and accumulator_dtype=None, float32
    gradients were rounded to bf16."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 1, accumulator_dtype=None)
    state = opt.init({"w": jnp.zeros(1, jnp.bfloat16)})
    with pytest.raises(
        TypeError,
        match=r"\['w'\] has dtype float32.*bfloat16.*accumulator_dtype=None"
        r".*accumulator_dtype=jnp.float32",
    ):
        opt.update({"w": jnp.array([1.001], jnp.float32)}, state)
    # The default accumulator (float32) takes them, unrounded.
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 1)
    state = opt.init({"w": jnp.zeros(1, jnp.bfloat16)})
    assert state.acc_grads["w"].dtype == jnp.float32  # as optax 0.2.8
    u, _ = opt.update({"w": jnp.array([1.001], jnp.float32)}, state)
    assert u["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(u["w"]), np.float32([-1.001]))


def test_float64_gradients_with_float32_params_under_x64():
    """Issue 13: under x64, float64 gradients with float32 params were
    rounded to float32. Now refused, and exact with accumulator_dtype=float64."""
    with jax.enable_x64(True):
        grads = [jnp.array([1 / 3, 1e-9 + 1.0], jnp.float64), jnp.array([0.1, 2.0])]
        opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
        state = opt.init(jnp.zeros(2, jnp.float32))
        with pytest.raises(
            TypeError, match=r"float64.*float32.*accumulator_dtype=jnp.float64"
        ):
            opt.update(grads[0], state)
        opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=jnp.float64)
        state = opt.init(jnp.zeros(2, jnp.float32))
        assert state.acc_grads.dtype == jnp.float64
        for g in grads:
            u, state = jax.jit(opt.update)(g, state)
        want = -(
            np.asarray(grads[0]) + (np.asarray(grads[1]) - np.asarray(grads[0])) / 2
        )
        assert u.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(u), want)


@pytest.mark.parametrize("jit", [False, True])
def test_float16_running_mean_does_not_overflow(jit):
    """Issue 13: in a float16 accumulator `g - acc` overflowed: the mean of
    6e4 and -6e4 gave inf."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=None)
    state = opt.init(jnp.zeros(2, jnp.float16))
    assert state.acc_grads.dtype == jnp.float16
    update = jax.jit(opt.update) if jit else opt.update
    _, state = update(jnp.array([6e4, -6e4], jnp.float16), state)
    u, state = update(jnp.array([-6e4, 6e4], jnp.float16), state)
    assert u.dtype == jnp.float16
    np.testing.assert_array_equal(to_np(u), [0.0, 0.0])
    # The largest float16 values: the mean of 65504 and 65504 is 65504.
    top = float(jnp.finfo(jnp.float16).max)
    _, state = update(jnp.array([top, -top], jnp.float16), state)
    u, _ = update(jnp.array([top, -top], jnp.float16), state)
    np.testing.assert_array_equal(to_np(u), [-top, top])


@pytest.mark.parametrize("apply", ["update", "apply_gradients"])
def test_bfloat16_accumulator_runs_where_optax_multisteps_raises(apply):
    """bfloat16 params accumulated in their own dtype (`accumulator_dtype=
    None`, the way round the H200's open fused case in
    docs/performance.md): optax 0.2.8's MultiSteps raises at its first
    jitted update (its conditional's branches return the accumulator in
    bfloat16 and float32); optax_ext's runs a window. Gradients 1, 2, 3,
    4 have running means exact in bfloat16 (1, 1.5, 2, 2.5), so the window
    gives Adam's update on 2.5, computed jitted by the bare optimizer."""
    params = {"w": jnp.full((3,), 0.5, jnp.bfloat16)}
    reference = optax.MultiSteps(optax.adam(1e-2), 4, accumulator_dtype=None)
    with pytest.raises(TypeError, match="cond branches"):
        jax.jit(reference.update)(params, reference.init(params), params)

    opt = optax_ext.MultiSteps(optax.adam(1e-2), 4, accumulator_dtype=None)
    state = opt.init(params)
    assert state.acc_grads["w"].dtype == jnp.bfloat16

    def step(p, s, g):
        if apply == "update":
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return optax_ext.apply_gradients(opt, g, s, p)

    step = jax.jit(step)
    new = params
    for v in (1.0, 2.0, 3.0, 4.0):
        new, state = step(new, state, {"w": jnp.full((3,), v, jnp.bfloat16)})
    bare = optax.adam(1e-2)

    @jax.jit
    def bare_step(p, g):
        u, _ = bare.update(g, bare.init(p), p)
        return optax.apply_updates(p, u)

    want = bare_step(params, {"w": jnp.full((3,), 2.5, jnp.bfloat16)})
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(to_np(new["w"]), to_np(want["w"]))
    assert not np.array_equal(to_np(new["w"]), to_np(params["w"]))


def test_float16_sum_beyond_range_is_inf():
    """With `use_grad_mean=False` a sum beyond float16's range is inf, as
    documented (the mean of the same gradients is finite)."""
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 2, use_grad_mean=False, accumulator_dtype=None
    )
    state = opt.init(jnp.zeros(1, jnp.float16))
    _, state = opt.update(jnp.array([6e4], jnp.float16), state)
    u, _ = opt.update(jnp.array([6e4], jnp.float16), state)
    assert np.isneginf(to_np(u)).all()


def test_float32_gradients_beyond_float16_range_with_float16_params():
    """Issue 13: float32 gradients of +-7e4 with float16 params gave NaN
    (accumulator_dtype=None). Now the float16 accumulator refuses them, and
    the default float32 accumulator averages them exactly."""
    grads = [jnp.array([7e4, -7e4], jnp.float32), jnp.array([-7e4, 7e4], jnp.float32)]
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=None)
    with pytest.raises(TypeError, match=r"float32.*float16.*accumulator_dtype"):
        opt.update(grads[0], opt.init(jnp.zeros(2, jnp.float16)))
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    state = opt.init(jnp.zeros(2, jnp.float16))
    for g in grads:
        u, state = opt.update(g, state)
    np.testing.assert_array_equal(np.asarray(u), [0.0, 0.0])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_params_with_the_default_accumulator(dtype):
    """Issue 13: init raised a raw TypePromotionError. float32 holds every
    float8 value: the accumulator is float32 and the mean is exact."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    state = opt.init({"w": jnp.zeros(2, dtype)})
    assert state.acc_grads["w"].dtype == jnp.float32
    grads = [{"w": jnp.array([1.0, -2.0], dtype)}, {"w": jnp.array([2.0, 3.0], dtype)}]
    for g in grads:
        u, state = jax.jit(opt.update)(g, state)
    assert u["w"].dtype == dtype
    np.testing.assert_array_equal(to_np(u["w"].astype(jnp.float32)), [-1.5, -0.5])


def test_accumulator_dtypes_match_optax_for_float32_and_bfloat16_params():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)}
    ours = optax_ext.MultiSteps(optax.adam(1e-2), 2).init(params)
    theirs = optax.MultiSteps(optax.adam(1e-2), 2).init(params)
    for a, b in zip(
        jax.tree.leaves(ours.acc_grads), jax.tree.leaves(theirs.acc_grads), strict=True
    ):
        assert a.dtype == b.dtype == jnp.float32


# --- Python scalars and integer leaves ----------------------------------------


def _run(impl, params, grads, k, inner=None):
    opt = impl(inner or optax.sgd(1.0), every_k_schedule=k)
    state = opt.init(params)
    outs = []
    update = jax.jit(opt.update)  # each compared jitted alike
    for g in grads:
        u, state = update(g, state, params)
        outs.append(u)
    return outs


def _assert_equal_trees(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jnp.result_type(a) == jnp.result_type(b)
        np.testing.assert_array_equal(to_np(a), to_np(b))


def test_python_float_gradient_leaf():
    """Issue 13: AttributeError 'float' object has no attribute 'astype'."""
    params = {"a": jnp.zeros(()), "b": jnp.zeros(2)}
    grads = [{"a": 1.0, "b": jnp.ones(2)}, {"a": 2.0, "b": jnp.ones(2)}]
    for inner in (optax.sgd(1.0), optax.adam(0.1)):
        ours = _run(optax_ext.MultiSteps, params, grads, 2, inner)
        theirs = _run(optax.MultiSteps, params, grads, 2, inner)
        _assert_equal_trees(ours[1], theirs[1])


def test_integer_gradient_leaves_accumulate_as_in_optax():
    """Issue 13: integer leaves were mapped to None, so integer gradients
    were refused; optax accumulates them (in float32, the mean truncated to
    the gradient's dtype before the inner optimizer)."""
    params = {"i": jnp.zeros(3, jnp.int32), "w": jnp.zeros(2)}
    grads = [
        {"i": jnp.array([3, 4, -7], jnp.int32), "w": jnp.ones(2)},
        {"i": jnp.array([4, 4, 2], jnp.int32), "w": jnp.ones(2)},
    ]
    ours = _run(optax_ext.MultiSteps, params, grads, 2)
    theirs = _run(optax.MultiSteps, params, grads, 2)
    _assert_equal_trees(ours, theirs)
    np.testing.assert_array_equal(np.asarray(ours[1]["i"]), [-3.0, -4.0, 2.0])


# --- property tests against numpy float64 --------------------------------------

FLOAT_DTYPES = ["float16", "bfloat16", "float32", "complex64"]


def _ulp(x, dtype):
    """The spacing of `dtype` at |x| (elementwise, float64)."""
    x = np.abs(np.asarray(x, np.float64))
    info = jnp.finfo(dtype)
    tiny = float(info.smallest_normal)
    exponent = np.floor(np.log2(np.maximum(x, tiny)))
    return np.exp2(exponent - info.nmant)


def _gradients(rng, dtype, n, size, scale):
    real = rng.normal(size=(n, size)) * scale
    if jnp.issubdtype(dtype, jnp.complexfloating):
        real = real + 1j * rng.normal(size=(n, size)) * scale
    return [jnp.asarray(g, dtype) for g in real]


def _window_means(grads, ks, mean=True):
    """float64 (or complex128) numpy means of consecutive windows."""
    out, start = [], 0
    for k in ks:
        window = np.stack(
            [np.asarray(to_np(g), np.complex128) for g in grads[start : start + k]]
        )
        out.append(window.mean(axis=0) if mean else window.sum(axis=0))
        start += k
    return out


@settings(max_examples=30)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    accumulator_dtype=st.sampled_from([jnp.float32, None]),
    ks=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    scale=st.sampled_from([1e-3, 1.0, 3e3]),
    use_grad_mean=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_accumulation_against_float64(
    dtype, accumulator_dtype, ks, scale, use_grad_mean, seed
):
    """Each window's emitted sgd(1) update is minus its mean (or sum),
    compared with numpy in float64.

    The accumulator (float32, or the gradient's float16/bfloat16 with
    `accumulator_dtype=None`, updated in float32 and rounded once per
    mini-step) keeps the running mean within 1.5 of its ulps at the window's
    largest gradient, whatever the window's length (measured worst: 1.15 over
    windows of 2 to 8 in a 6000-window simulation of float32 and float16).
    A drift of one ulp per mini-step exceeds that from the third mini-step
    on. The sum (`use_grad_mean=False`) is within half an ulp of the running
    total per addition. The result rounded to the gradient's dtype is then
    within one ulp of that dtype.
    """
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    grads = _gradients(rng, dtype, sum(ks), 5, scale)
    acc_dtype = jnp.dtype(
        dtype if accumulator_dtype is None else jnp.promote_types(dtype, jnp.float32)
    )
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0),
        every_k_schedule=lambda step: jnp.asarray(ks)[jnp.minimum(step, len(ks) - 1)],
        use_grad_mean=use_grad_mean,
        accumulator_dtype=accumulator_dtype,
    )
    state = opt.init(jnp.zeros(5, dtype))
    assert state.acc_grads.dtype == acc_dtype
    step = jax.jit(opt.update)
    emitted = []
    for g in grads:
        u, state = step(g, state)
        assert u.dtype == dtype
        if bool(opt.has_updated(state)):
            emitted.append(-np.asarray(to_np(u), np.complex128))
        else:
            assert not np.any(to_np(u))
    want = _window_means(grads, ks, mean=use_grad_mean)
    assert len(emitted) == len(want)
    start = 0
    for got, ref, k in zip(emitted, want, ks, strict=True):
        window = np.stack([np.abs(to_np(g)) for g in grads[start : start + k]])
        start += k
        top = window.max(axis=0) * (1 if use_grad_mean else k)
        complex_factor = 2.0 if dtype.kind == "c" else 1.0  # two components
        if k == 1:
            acc_err = 0.0
        elif use_grad_mean:
            acc_err = 1.5 * _ulp(top, acc_dtype) * complex_factor
        else:
            acc_err = 0.5 * (k - 1) * _ulp(top, acc_dtype) * complex_factor
        # Then rounded once to the gradient's dtype.
        final = 0.0
        if acc_dtype != dtype:
            final = _ulp(np.maximum(np.abs(ref), np.abs(got)), dtype) * complex_factor
        bound = acc_err + final
        err = np.abs(got - ref)
        assert (err <= bound).all(), (dtype, acc_dtype, k, err, bound, got, ref)


@settings(max_examples=10)
@given(
    ks=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_float64_accumulation_under_x64(ks, seed):
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        grads = [jnp.asarray(g, jnp.float64) for g in rng.normal(size=(sum(ks), 4))]
        opt = optax_ext.MultiSteps(
            optax.sgd(1.0),
            every_k_schedule=lambda s: jnp.asarray(ks)[jnp.minimum(s, len(ks) - 1)],
        )
        state = opt.init(jnp.zeros(4, jnp.float64))
        assert state.acc_grads.dtype == jnp.float64
        emitted = []
        for g in grads:
            u, state = jax.jit(opt.update)(g, state)
            if bool(opt.has_updated(state)):
                emitted.append(-np.asarray(u))
        want = _window_means([np.asarray(g) for g in grads], ks)
        for got, ref in zip(emitted, want, strict=True):
            eps = np.finfo(np.float64).eps
            assert np.all(
                np.abs(got - ref.real) <= 8 * eps * np.abs(grads[0]).max() + 4 * eps
            )


@settings(max_examples=15)
@given(
    leaves=st.lists(
        st.sampled_from(["pyfloat_param", "pyfloat_grad", "int", "float32"]),
        min_size=1,
        max_size=4,
    ),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_scalar_and_integer_leaves_equal_optax(leaves, k, seed):
    """Python float params, Python float gradients and integer leaves give
    optax.MultiSteps' updates exactly (adam inside), and the float leaves the
    float64 reference's within float32 rounding."""
    rng = np.random.default_rng(seed)
    params, grads = {}, [dict() for _ in range(k)]
    for i, kind in enumerate(leaves):
        name = f"{i}_{kind}"
        if kind == "pyfloat_param":
            params[name] = float(rng.normal())
            for g in grads:
                g[name] = jnp.float32(rng.normal())
        elif kind == "pyfloat_grad":
            params[name] = jnp.zeros(())
            for g in grads:
                g[name] = float(rng.normal())
        elif kind == "int":
            params[name] = jnp.zeros(3, jnp.int32)
            for g in grads:
                g[name] = jnp.asarray(rng.integers(-9, 9, size=3), jnp.int32)
        else:
            params[name] = jnp.zeros(3)
            for g in grads:
                g[name] = jnp.asarray(rng.normal(size=3), jnp.float32)
    for inner in (optax.sgd(1.0), optax.adam(0.1)):
        ours = _run(optax_ext.MultiSteps, params, grads, k, inner)
        theirs = _run(optax.MultiSteps, params, grads, k, inner)
        _assert_equal_trees(ours[-1], theirs[-1])


# --- bad constructor arguments ---------------------------------------------------


@settings(max_examples=40)
@given(
    every_k=st.one_of(
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=True),
        st.booleans(),
        st.none(),
        st.text(max_size=3),
    ),
)
@example(every_k=2**31)
@example(every_k=0)
@example(every_k=2.5)
def test_bad_every_k_is_refused_at_construction(every_k):
    # A bool is the int it is, as in optax: True is 1, False is refused as 0.
    valid = isinstance(every_k, int) and 1 <= every_k <= 2**31 - 1
    if valid:
        optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=every_k)
        return
    with pytest.raises((TypeError, ValueError), match="every_k_schedule") as info:
        optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=every_k)
    assert repr(every_k)[:20] in str(info.value) or str(every_k) in str(info.value)


@settings(max_examples=20)
@given(
    dtype=st.sampled_from(
        [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_, "float", "x", 1.5, object()]
    )
)
def test_bad_accumulator_dtype_is_refused_at_construction(dtype):
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)
    except TypeError:
        ok = False
    if ok:
        optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=dtype)
        return
    with pytest.raises(TypeError, match="accumulator_dtype must be a floating"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=dtype)


def test_bool_params_leaf_holds_no_accumulator():
    """Documented (docs/multi_steps.md, Numerics): a bool leaf holds `None`,
    where optax.MultiSteps keeps a float32 accumulator; its `None`
    gradient gives a `None` update, and the float leaf is sgd on the mean."""
    params = {"w": jnp.ones(2), "m": jnp.array([True, False])}
    opt = optax_ext.MultiSteps(optax.sgd(0.5), 2)
    state = opt.init(params)
    assert state.acc_grads["m"] is None
    assert optax.MultiSteps(optax.sgd(0.5), 2).init(params).acc_grads["m"] is not None
    for g in (1.0, 3.0):
        u, state = opt.update({"w": jnp.full(2, g), "m": None}, state, params)
    assert u["m"] is None
    np.testing.assert_array_equal(u["w"], jnp.full(2, -0.5 * 2.0))
