"""MultiSteps(weighted=True): the window emits the gradient of the mean over
all of its tokens, sum_i n_i g_i / sum_i n_i, where micro-batch i holds n_i
non-padding tokens and g_i is its own token-mean gradient.

The reference is independent of optax_ext: the gradient of the token-mean
loss of the concatenated window, computed directly (in float64, rounded once
to float32: `_tokens.py`), and the inner optax optimizer applied to it by
plain optax, jitted as the accumulating step is.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import avals
from _tokens import concat, grad, micro_batch, params32, tokens
from hypothesis import HealthCheck, given, settings

import optax_ext

K = 4
# Uneven token counts (of 32 places), an all-padding micro-batch (its
# token-mean gradient is NaN: 0 / 0) and a window with two of them.
WINDOWS = [[5, 17, 32, 9], [0, 12, 3, 30], [20, 0, 0, 1]]
INNERS = {
    "sgd": lambda: optax.sgd(0.5),
    "adam": lambda: optax.adam(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
}
FORMS = ["update", "apply_gradients"]


def _batches(windows, seed=0):
    return [
        [micro_batch(seed + 100 * w + i, n) for i, n in enumerate(window)]
        for w, window in enumerate(windows)
    ]


def _assert_close(got, want, rtol=1e-6):
    """float32 against float32 rounded from a float64 reference: rtol 1e-6
    elementwise, with an absolute floor of 1e-6 of the leaf's largest
    entry (an entry near 0 is a difference of larger terms)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
        b = np.asarray(_at(want, path))
        a = np.asarray(a)
        assert a.dtype == b.dtype, (path, a.dtype, b.dtype)
        atol = rtol * float(np.max(np.abs(b), initial=0.0))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=str(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def _reference(make_inner, params, windows):
    """Plain optax on each window's concatenated batch; a window without a
    token applies nothing. Returns the updates and params after each
    window."""
    inner = make_inner()
    state = inner.init(params)
    update = jax.jit(inner.update)
    out = []
    for window in windows:
        batch = concat(window)
        if tokens(batch) == 0:
            out.append((None, params))
            continue
        updates, state = update(grad(params, batch), state, params)
        params = optax.apply_updates(params, updates)
        out.append((updates, params))
    return out


def _weighted_run(opt, params, windows, form):
    """The user's loop: each micro-batch's own token-mean gradient and its
    token count. Returns the emitted updates (drop-in form) and the params
    at each window's end, and the state."""
    if form == "update":

        @jax.jit
        def step(grads, state, params, weight):
            updates, state = opt.update(grads, state, params, weight=weight)
            return optax.apply_updates(params, updates), state, updates

    else:

        @jax.jit
        def step(grads, state, params, weight):
            params, state = optax_ext.apply_gradients(
                opt, grads, state, params, weight=weight
            )
            return params, state, None

    state = opt.init(params)
    out = []
    for window in windows:
        for batch in window:
            params, state, updates = step(
                grad(params, batch), state, params, tokens(batch)
            )
        out.append((updates, params))
    return out, state


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("inner", INNERS)
def test_weighted_window_equals_inner_optimizer_on_big_batch_token_mean(
    inner, form, window_form
):
    params = params32()
    windows = _batches(WINDOWS)
    opt = window_form(optax_ext.MultiSteps(INNERS[inner](), K, weighted=True))
    got, state = _weighted_run(opt, params, windows, form)
    want = _reference(INNERS[inner], params, windows)
    for (got_updates, got_params), (want_updates, want_params) in zip(
        got, want, strict=True
    ):
        if form == "update":
            _assert_close(got_updates, want_updates)
        _assert_close(got_params, want_params)
    assert int(state.gradient_step) == len(WINDOWS)
    assert float(state.acc_weight) == 0.0 and int(state.mini_step) == 0


def test_unweighted_mean_misses_the_big_batch_on_these_windows():
    """The windows above discriminate: the plain mean of the micro-batches'
    token means (optax.MultiSteps) is far from the big batch's gradient, so
    the test above would fail for a weighting that did nothing. (The
    all-padding micro-batches are left out: their gradient is NaN.)"""
    params = params32()
    windows = _batches(WINDOWS[:1])
    grads = [grad(params, b) for b in windows[0]]
    plain = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    big = grad(params, concat(windows[0]))
    gap = np.linalg.norm(plain["out"] - big["out"]) / np.linalg.norm(big["out"])
    assert gap > 0.05


@pytest.mark.parametrize("form", FORMS)
def test_all_padding_window_emits_zeros_and_keeps_inner_state(form):
    """A window whose weights sum to 0 (and whose gradients are NaN) applies
    nothing: zero updates, the params and the inner state as they were, no
    NaN anywhere, and the window count does not advance; the next window
    continues as if it had not happened."""
    params = params32()
    windows = _batches([[3, 20, 7, 1], [0, 0, 0, 0], [9, 0, 31, 2]])
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, weighted=True)
    got, state = _weighted_run(opt, params, windows, form)
    want = _reference(INNERS["adam"], params, windows)
    (_, after_first), (zero_updates, after_zero), _ = got
    np.testing.assert_array_equal(after_zero["out"], after_first["out"])
    for leaf in jax.tree.leaves(after_zero):
        assert np.all(np.isfinite(leaf))
    if form == "update":
        for leaf in jax.tree.leaves(zero_updates):
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    _assert_close(got[2][1], want[2][1])
    assert int(state.gradient_step) == 2
    # adam's own count saw two updates, not three.
    assert int(state.inner_opt_state[0].count) == 2


def test_all_padding_window_leaves_inner_state_bit_identical():
    params = params32()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), 2, weighted=True)
    step = jax.jit(lambda g, s, p, w: opt.update(g, s, p, weight=w))
    state = opt.init(params)
    g = grad(params, micro_batch(1, 10))
    _, state = step(g, state, params, 10)
    _, state = step(g, state, params, 3)
    before = state.inner_opt_state
    nan = jax.tree.map(lambda v: np.full_like(v, np.nan), g)
    _, state = step(nan, state, params, 0)
    updates, state = step(nan, state, params, 0.0)
    for a, b in zip(
        jax.tree.leaves(state.inner_opt_state), jax.tree.leaves(before), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert not any(np.isnan(a).any() for a in jax.tree.leaves(state.acc_grads))


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.lists(st.integers(0, 32), min_size=K, max_size=K), min_size=1, max_size=3
    ),
    st.integers(0, 2**16),
)
def test_random_token_counts_give_the_big_batch_gradient(window_form, windows, seed):
    """sgd(1.0)'s update is minus the emitted gradient: it equals minus the
    big batch's token-mean gradient for any token counts, zeros included."""
    params = params32()
    batches = _batches(windows, seed)
    got, _ = _weighted_run(
        window_form(optax_ext.MultiSteps(optax.sgd(1.0), K, weighted=True)),
        params,
        batches,
        "update",
    )
    want = _reference(lambda: optax.sgd(1.0), params, batches)
    for (got_updates, _), (want_updates, _) in zip(got, want, strict=True):
        if want_updates is None:  # a window without tokens
            for leaf in jax.tree.leaves(got_updates):
                np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
        else:
            _assert_close(got_updates, want_updates)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_params_keep_dtypes_and_state_avals(dtype):
    """bfloat16/float16 params: the accumulator is float32, the emitted
    updates have the params' dtype, the state's avals never change (no
    retrace), and the emitted gradient is the weighted mean of the
    half-precision gradients computed in float64 (sgd(1.0))."""
    params = jax.tree.map(lambda p: p.astype(dtype), params32())
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 3, weighted=True)
    traces = []

    @jax.jit
    def step(g, s, p, w):
        traces.append(None)
        return opt.update(g, s, p, weight=w)

    state = opt.init(params)
    init_avals = avals(state)
    rng = np.random.default_rng(3)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), dtype), params)
        for _ in range(3)
    ]
    weights = [5, 0, 2]
    for g, w in zip(grads, weights, strict=True):
        updates, state = step(g, state, params, w)
        assert avals(state) == init_avals
    assert len(traces) == 1
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        assert u.dtype == dtype
        gs = [np.asarray(_at(g, path), np.float64) for g in grads]
        want = -sum(w * g for w, g in zip(weights, gs, strict=True)) / sum(weights)
        np.testing.assert_array_equal(
            np.asarray(u), np.asarray(jnp.asarray(want, jnp.float32).astype(dtype))
        )


def test_weight_is_consumed_not_forwarded():
    """The inner optimizer never sees `weight`; other extra args pass."""
    seen = []
    sgd = optax.sgd(1.0)

    def update(updates, state, params=None, **extra):
        seen.append(sorted(extra))
        return sgd.update(updates, state, params)

    inner = optax.GradientTransformationExtraArgs(sgd.init, update)
    opt = optax_ext.MultiSteps(inner, 1, weighted=True)
    params = params32()
    state = opt.init(params)
    opt.update(params, state, params, weight=3, value=1.0)
    optax_ext.apply_gradients(opt, params, state, params, weight=3, value=1.0)
    assert seen and all(extra == ["value"] for extra in seen)


def test_state_types():
    params = params32()
    plain = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    assert type(plain.init(params)) is optax.MultiStepsState
    state = optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=True).init(params)
    assert isinstance(state, optax_ext.WeightedMultiStepsState)
    assert state[:5] == tuple(getattr(state, f) for f in optax.MultiStepsState._fields)
    assert state.acc_weight.dtype == jnp.float32 and state.acc_weight.shape == ()


def test_equality_and_hash_include_weighted():
    inner = optax.sgd(1.0)
    a = optax_ext.MultiSteps(inner, 2, weighted=True)
    b = optax_ext.MultiSteps(inner, 2, weighted=True)
    c = optax_ext.MultiSteps(inner, 2)
    assert a == b and hash(a) == hash(b)
    assert a != c


def test_traced_weight_is_one_compilation_for_all_counts():
    params = params32()
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=True)
    traces = []

    @jax.jit
    def step(g, s, p, w):
        traces.append(None)
        return opt.update(g, s, p, weight=w)

    state = opt.init(params)
    for w in (3, 17, 0, 5):
        _, state = step(params, state, params, jnp.int32(w))
    assert len(traces) == 1


# --- errors -----------------------------------------------------------------


def _opt(weighted=True):
    return optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=weighted)


def test_missing_weight_is_named():
    opt, params = _opt(), params32()
    with pytest.raises(TypeError, match=r"needs `weight=`"):
        opt.update(params, opt.init(params), params)
    with pytest.raises(TypeError, match=r"needs `weight=`"):
        optax_ext.apply_gradients(opt, params, opt.init(params), params)


def test_weight_without_weighted_is_named():
    opt, params = _opt(False), params32()
    with pytest.raises(TypeError, match=r"got weight=.*without weighted=True"):
        opt.update(params, opt.init(params), params, weight=3)
    with pytest.raises(TypeError, match=r"got weight=.*without weighted=True"):
        optax_ext.apply_gradients(opt, params, opt.init(params), params, weight=3)


@pytest.mark.parametrize(
    "weight, error, match",
    [
        (jnp.ones(2), TypeError, r"real scalar >= 0.*shape \(2,\)"),
        (True, TypeError, r"real scalar >= 0.*True"),
        (1j, TypeError, r"real scalar >= 0"),
        ("3", TypeError, r"real scalar >= 0"),
        (-1, ValueError, r"finite and >= 0, got -1"),
        (float("nan"), ValueError, r"finite and >= 0, got nan"),
        (jnp.float32(-2.0), ValueError, r"finite and >= 0, got -2"),
        # float32 sums the weights: XLA flushed 1e-39 to 0, and the window
        # emitted zeros with no sign; 1e39 is infinity there.
        (1e-39, ValueError, r"is 1e-39, which .* float32 keeps 1.18e-38 to 3.4e\+38"),
        (1e39, ValueError, r"is 1e\+39, which .*float32.*do not hold"),
    ],
)
def test_bad_weight_is_refused(weight, error, match):
    opt, params = _opt(), params32()
    with pytest.raises(error, match=match):
        opt.update(params, opt.init(params), params, weight=weight)


def test_negative_weight_under_jit_known_at_trace_time_is_refused():
    opt, params = _opt(), params32()
    with pytest.raises(ValueError, match="finite and >= 0"):
        jax.jit(lambda s: opt.update(params, s, params, weight=-3))(opt.init(params))


def test_state_of_the_other_kind_is_refused():
    params = params32()
    weighted, plain = _opt(True), _opt(False)
    with pytest.raises(TypeError, match="has no acc_weight"):
        weighted.update(params, plain.init(params), params, weight=1)
    other = r"got a WeightedMultiStepsState with the fields \[.acc_weight.\]"
    with pytest.raises(TypeError, match=other):
        plain.update(params, weighted.init(params), params)
    # The fused step names the function called and its argument.
    with pytest.raises(
        TypeError,
        match=r"optax_ext\.apply_gradients's `opt_state` has no acc_weight",
    ):
        optax_ext.apply_gradients(
            weighted, params, plain.init(params), params, weight=1
        )


@pytest.mark.parametrize(
    "acc_weight", [jnp.zeros((), jnp.int32), jnp.zeros(3), [0.0]], ids=str
)
def test_running_weight_of_another_kind_is_named(acc_weight):
    """A restored `acc_weight` that is no float scalar (an int, a vector, a
    list) is named with what was given, before it reaches the fold."""
    opt, params = _opt(), params32()
    state = opt.init(params)._replace(acc_weight=acc_weight)
    with pytest.raises(TypeError, match=r"`state\.acc_weight` must be a float scalar"):
        opt.update(params, state, params, weight=1)


def test_weighted_state_has_no_optax_form():
    """`optax_state` refuses a weighted state: optax.MultiSteps would take
    it, read its fields by name and drop `acc_weight` without a word."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=True)
    _, state = opt.update(jnp.ones(3), opt.init(jnp.zeros(3)), weight=5.0)
    with pytest.raises(TypeError, match="would drop its acc_weight"):
        opt.optax_state(state)
    plain = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(TypeError, match="would drop its acc_weight"):
        plain.optax_state(state)


def test_weighted_must_be_a_bool():
    with pytest.raises(TypeError, match="weighted must be True or False"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted="yes")


def test_orbax_round_trip_mid_window_continues_bit_identical_without_retrace(
    tmp_path,
):
    """Saved after 2 of a window's 4 mini-steps (the running weight is in the
    state), restored by orbax into the abstract state of a fresh process,
    the run continues as the uninterrupted one, bit for bit, in the same
    compiled step. Reference: the uninterrupted run."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = params32()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, weighted=True)
    batches = [micro_batch(i, n) for i, n in enumerate([5, 30, 0, 12, 7, 19])]
    grads = [grad(params, b) for b in batches]
    weights = [tokens(b) for b in batches]
    traces = []

    @jax.jit
    def step(params, state, g, w):
        traces.append(None)
        updates, state = opt.update(g, state, params, weight=w)
        return optax.apply_updates(params, updates), state

    def run(params, state, steps):
        for i in steps:
            params, state = step(params, state, grads[i], weights[i])
        return params, state

    want = run(params, opt.init(params), range(6))
    mid = run(params, opt.init(params), range(2))
    assert float(mid[1].acc_weight) == weights[0] + weights[1]
    abstract = {
        "params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params),
        "opt_state": jax.eval_shape(opt.init, params),
    }
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(
            2, args=ocp.args.StandardSave(dict(params=mid[0], opt_state=mid[1]))
        )
        manager.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        restored = manager.restore(2, args=ocp.args.StandardRestore(abstract))
    assert isinstance(restored["opt_state"], optax_ext.WeightedMultiStepsState)
    assert avals(restored["opt_state"]) == avals(mid[1])
    got = run(restored["params"], restored["opt_state"], range(2, 6))
    assert len(traces) == 1, "the restored state retraced the step"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_example_weighted_tokens_trains_with_no_gap():
    """examples/weighted_tokens.py: the loss falls, the weighted gradient and
    adamw update are the whole window's (float32 rounding), and the
    unweighted ones are far off."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "weighted_tokens.py"
    spec = importlib.util.spec_from_file_location("weighted_tokens", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    losses, gaps = ex.train(windows=8, bucketed=True)
    assert losses[-1] < losses[0], losses
    assert gaps["weighted gradient"] < 1e-5 and gaps["weighted update"] < 1e-5, gaps
    assert gaps["unweighted gradient"] > 1e-2, gaps


def test_skipped_mini_step_counts_neither_gradient_nor_weight():
    """With should_skip_update_fn=optax.skip_not_finite, a mini-step whose
    gradient is not finite (weight above 0) is skipped: the window emits
    the token mean of the others, as plain optax on their concatenation."""
    params = params32()
    batches = [micro_batch(i, n) for i, n in enumerate([7, 12, 25])]
    grads = [grad(params, b) for b in batches]
    bad = jax.tree.map(lambda g: np.full_like(g, np.inf), grads[0])
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite, weighted=True
    )
    step = jax.jit(lambda g, s, w: opt.update(g, s, params, weight=w))
    state = opt.init(params)
    _, state = step(grads[0], state, tokens(batches[0]))
    _, state = step(bad, state, 30)
    updates, state = step(grads[2], state, tokens(batches[2]))
    (want, _), *_ = _reference(
        lambda: optax.sgd(1.0), params, [[batches[0], batches[2]]]
    )
    _assert_close(updates, want)
    assert int(state.gradient_step) == 1


def test_inside_chain_through_gradient_transformation():
    """`weight=` reaches MultiSteps through optax.chain's extra arguments."""
    params = params32()
    batches = [micro_batch(i, n) for i, n in enumerate([3, 29])]
    ms = optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=True)
    opt = optax.chain(ms.gradient_transformation(), optax.scale(2.0))
    step = jax.jit(lambda g, s, w: opt.update(g, s, params, weight=w))
    state = opt.init(params)
    for b in batches:
        updates, state = step(grad(params, b), state, tokens(b))
    (want, _), *_ = _reference(
        lambda: optax.chain(optax.sgd(1.0), optax.scale(2.0)), params, [batches]
    )
    _assert_close(updates, want)


def test_numpy_int64_and_huge_python_weights_are_not_wrapped():
    """`mask.sum()` in NumPy is an int64: JAX made it an int32 first, so a
    weight of 2**33 wrapped to 0 and its gradient was dropped silently (a
    Python 2**40 raised an OverflowError). Reference: the weighted mean by
    hand, 2**33 * 1 + 1 * 0 over 2**33 + 1, which is 1 in float32."""
    params = {"w": jnp.zeros(2)}
    for big in (np.int64(2**33), 2**40):
        opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, weighted=True)
        state = opt.init(params)
        _, state = opt.update({"w": jnp.ones(2)}, state, params, weight=big)
        updates, _ = opt.update({"w": jnp.zeros(2)}, state, params, weight=1)
        np.testing.assert_array_equal(updates["w"], -np.ones(2, np.float32))


def test_zero_weight_step_is_not_seen_by_the_skip_function():
    """A weight-0 mini-step's gradient is not read: with
    `should_skip_update_fn=optax.skip_not_finite` its NaN (an all-padding
    micro-batch) made the step skipped, so it did not count and the window
    took in the next micro-batch. Reference: the same run without a skip
    function, windows of 2 by hand: (1*3 + nan*0) / 3 = 1, then
    (2*5 + 4*1) / 6."""
    params = {"w": jnp.zeros(1)}
    steps = ((1.0, 3), (float("nan"), 0), (2.0, 5), (4.0, 1))
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 2, weighted=True, should_skip_update_fn=optax.skip_not_finite
    )
    state = opt.init(params)
    update = jax.jit(opt.update)
    got = []
    for g, w in steps:
        updates, state = update({"w": jnp.full(1, g)}, state, params, weight=w)
        got.append(float(updates["w"][0]))
    assert got == [0.0, -1.0, 0.0, float(np.float32(-(2 * 5 + 4 * 1) / 6))]
    assert int(state.gradient_step) == 2
    assert int(state.skip_state["num_not_finite"]) == 0
