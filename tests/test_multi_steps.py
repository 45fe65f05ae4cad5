"""MultiSteps: gradient accumulation contracts, against hand-made references.

Tests parametrised with `impl` also run optax.MultiSteps, marked as a strict
expected failure where upstream fails the contract: the suite shows which
contracts optax breaks and would notice if it stopped breaking them.
"""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_close_across_programs, assert_exact_zeros, avals, to_np
from hypothesis import HealthCheck, given, settings

import optax_ext

nan, inf = float("nan"), float("inf")


def upstream(reason, raises=None):
    return pytest.param(
        optax.MultiSteps,
        marks=pytest.mark.xfail(strict=True, reason=f"optax: {reason}", raises=raises),
        id="optax-xfail",
    )


OURS = pytest.param(optax_ext.MultiSteps, id="optax_ext")


# --- an inner optimizer whose state holds every kind of leaf -----------------

ZOO_DTYPES = [
    "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32",
    "float16", "bfloat16", "float32", "complex64",
]  # fmt: skip


def _zoo_leaf(dtype, shape):
    return jnp.zeros(shape, dtype)


def _bump(x):
    """One step of a leaf: a change that keeps dtype, shape and weak type."""
    if x.dtype == jnp.bool_:
        return jnp.logical_not(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.split(x.reshape(-1)[0], x.size).reshape(x.shape)
    return x + 1  # a Python 1 keeps the dtype and weak type of x


def state_zoo(leaves, promote=False):
    """Inner optimizer: its state is `leaves`, each bumped once per update.

    With `promote=True` it misbehaves the way optax's old blending did
    (optax #828): bool leaves come back as int32, weak leaves as strong ones,
    half-precision leaves as float32.
    """

    def init(params):
        del params
        return dict(leaves)

    def update(updates, state, params=None):
        del params
        new = {k: _bump(v) for k, v in state.items()}
        if promote:
            for k, v in new.items():
                if v.dtype == jnp.bool_:
                    new[k] = v.astype(jnp.int32)
                elif v.dtype in (jnp.float16, jnp.bfloat16) or getattr(
                    v, "weak_type", False
                ):
                    new[k] = jnp.asarray(v, jnp.float32)
        return jax.tree.map(lambda g: -g, updates), new

    return optax.GradientTransformation(init, update)


def zoo_leaves():
    leaves = {d: _zoo_leaf(d, (2,)) for d in ZOO_DTYPES}
    leaves["scalar_bool"] = jnp.zeros((), bool)  # zero_nans' found_nan
    leaves["weak_float"] = jnp.asarray(0.0)  # weak
    leaves["weak_int"] = jnp.asarray(0)  # weak
    leaves["typed_key"] = jax.random.key(0)
    leaves["raw_key"] = jax.random.PRNGKey(0)  # uint32[2]
    return leaves


def _expected_zoo(leaves, n_emits):
    out = dict(leaves)
    for _ in range(n_emits):
        out = {k: _bump(v) for k, v in out.items()}
    return out


def _assert_zoo_equal(got, want):
    assert avals(got) == avals(want)
    for k in want:
        g, w = got[k], want[k]
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_array_equal(to_np(g), to_np(w), err_msg=k)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impl", [OURS, upstream("weak types and keys are lost")])
def test_inner_state_keeps_every_leaf_kind(impl, jit):
    leaves = zoo_leaves()
    opt = impl(state_zoo(leaves), every_k_schedule=3)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update
    for step in range(1, 8 if jit else 5):
        _, state = update({"w": jnp.full(3, float(step))}, state, params)
        # The inner state has moved once per emitted window and not otherwise.
        _assert_zoo_equal(state.inner_opt_state, _expected_zoo(leaves, step // 3))


def test_inner_state_keeps_leaf_kinds_under_x64():
    with jax.enable_x64(True):
        leaves = {
            d: jnp.zeros((2,), d)
            for d in ["float64", "int64", "uint64", "complex128", "float32"]
        }
        leaves["weak64"] = jnp.asarray(0.0)
        assert leaves["weak64"].dtype == jnp.float64
        opt = optax_ext.MultiSteps(state_zoo(leaves), every_k_schedule=2)
        params = {"w": jnp.zeros(2, jnp.float64)}
        state = opt.init(params)
        update = jax.jit(opt.update)
        for step in range(1, 6):
            _, state = update({"w": jnp.ones(2, jnp.float64)}, state, params)
            _assert_zoo_equal(state.inner_opt_state, _expected_zoo(leaves, step // 2))
        assert state.acc_grads["w"].dtype == jnp.float64  # no loss of precision


def test_misbehaving_inner_optimizer_is_conformed():
    """An inner optimizer that promotes its own state still leaves MultiSteps'
    state with the avals it had at init (optax #828, #377, #1038, #1552)."""
    leaves = zoo_leaves()
    opt = optax_ext.MultiSteps(state_zoo(leaves, promote=True), every_k_schedule=2)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    want = avals(state)
    step = jax.jit(opt.update)
    for _ in range(5):
        _, state = step({"w": jnp.ones(3)}, state, params)
        assert avals(state) == want


@settings(max_examples=12)
@given(
    dtypes=st.lists(st.sampled_from(ZOO_DTYPES), min_size=1, max_size=4),
    shape=st.sampled_from([(), (1,), (3,), (2, 2)]),
    k=st.integers(1, 4),
    steps=st.integers(1, 9),
)
def test_inner_state_property(dtypes, shape, k, steps):
    leaves = {f"{i}_{d}": _zoo_leaf(d, shape) for i, d in enumerate(dtypes)}
    opt = optax_ext.MultiSteps(state_zoo(leaves), every_k_schedule=k)
    params = [jnp.zeros(shape, jnp.bfloat16)]
    state = opt.init(params)
    update = jax.jit(opt.update)
    for _ in range(steps):
        _, state = update([jnp.ones(shape, jnp.bfloat16)], state, params)
    _assert_zoo_equal(state.inner_opt_state, _expected_zoo(leaves, steps // k))


# --- non-emitting steps return exact zeros -----------------------------------


def _always_inf():
    def update(updates, state, params=None):
        return jax.tree.map(lambda u: jnp.full_like(u, inf), updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize(
    "impl, jit, dtype",
    [
        pytest.param(
            optax_ext.MultiSteps,
            jit,
            dtype,
            id=f"optax_ext-{'jit' if jit else 'eager'}-{jnp.dtype(dtype).name}",
        )
        for jit in (False, True)
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
    ]
    # XLA rewrites optax's `emit * inf` into a select for some dtypes; for
    # bfloat16 it stays a product and gives NaN.
    + [
        pytest.param(
            optax.MultiSteps,
            True,
            jnp.bfloat16,
            marks=pytest.mark.xfail(strict=True),
            id="optax-jit-bfloat16-xfail_0_times_inf_is_nan",
        )
    ],
)
def test_non_emitting_steps_are_exact_zeros(impl, jit, dtype):
    opt = impl(_always_inf(), every_k_schedule=3)
    params = {"w": jnp.zeros(4, dtype)}
    state = opt.init(params)
    step = jax.jit(opt.update) if jit else opt.update
    for i in range(6):
        updates, state = step({"w": jnp.ones(4, dtype)}, state, params)
        if i % 3 != 2:
            assert_exact_zeros(updates, like={"w": jnp.zeros(4, dtype)})
        else:
            assert np.isinf(to_np(updates["w"])).all()


@pytest.mark.parametrize("impl", [OURS, upstream("returns 0 * -inf = nan")])
def test_inf_gradient_gives_zeros_on_mini_steps(impl):
    opt = impl(optax.sgd(1.0), every_k_schedule=3)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    updates, state = opt.update({"w": jnp.array([inf, 1.0])}, state, params)
    assert_exact_zeros(updates)


# --- NaN and inf never cross a window ----------------------------------------


@pytest.mark.parametrize("bad", [nan, inf])
@pytest.mark.parametrize("impl", [OURS, upstream("resets with 0 * acc")])
def test_bad_value_stays_in_its_window(impl, bad, window_form):
    """The reproducer of upstream-optax.md item 1, with NaN and with inf."""
    opt = impl(optax.chain(optax_ext.zero_nans(), optax.sgd(1.0)), every_k_schedule=2)
    if isinstance(opt, optax_ext.MultiSteps):
        opt = window_form(opt)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    emitted = []
    for g in [[bad, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [3.0, 5.0], [1.0, 1.0]]:
        updates, state = opt.update({"w": jnp.array(g)}, state, params)
        emitted.append(to_np(updates["w"]))
    np.testing.assert_array_equal(emitted[3], [-1.0, -1.0])
    np.testing.assert_array_equal(emitted[5], [-2.0, -3.0])
    assert np.isfinite(to_np(state.acc_grads["w"])).all()


# --- emitting steps equal the inner optimizer on the window mean -------------


def _reference_run(make_inner, grads, ks, use_grad_mean):
    """Plain optax on the mean (or sum) of each window, by hand."""
    inner = make_inner()
    state = inner.init(jnp.zeros_like(grads[0]))
    outs, window = [], []
    gradient_step = 0
    for g in grads:
        window.append(np.asarray(g, np.float64))
        if len(window) == ks(gradient_step):
            total = np.sum(window, axis=0)
            acc = total / len(window) if use_grad_mean else total
            u, state = inner.update(jnp.asarray(acc, jnp.float32), state)
            outs.append(to_np(u))
            window, gradient_step = [], gradient_step + 1
        else:
            outs.append(np.zeros(g.shape))
    return outs


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    k_table=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    n_steps=st.integers(1, 12),
    use_grad_mean=st.booleans(),
    seed=st.integers(0, 2**16),
    as_function=st.booleans(),
)
def test_emitted_updates_match_reference(
    k_table, n_steps, use_grad_mean, seed, as_function, window_form
):
    if as_function:

        def ks(step):
            return jnp.asarray(k_table)[jnp.minimum(step, len(k_table) - 1)]

        def ks_py(step):
            return k_table[min(step, len(k_table) - 1)]

    else:
        ks, ks_py = k_table[0], lambda _: k_table[0]
    grads = list(
        np.random.default_rng(seed).normal(size=(n_steps, 3)).astype(np.float32)
    )

    def make():
        return optax.adam(0.1)

    opt = optax_ext.MultiSteps(make(), every_k_schedule=ks, use_grad_mean=use_grad_mean)
    opt = window_form(opt)
    params = jnp.zeros(3)
    state = opt.init(params)
    want = _reference_run(make, grads, ks_py, use_grad_mean)
    step = jax.jit(opt.update)
    for g, w in zip(grads, want, strict=True):
        u, state = step(jnp.asarray(g), state, params)
        np.testing.assert_allclose(to_np(u), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make", [optax.scale_by_adam, optax.scale_by_lion], ids=["adam", "lion"]
)
@pytest.mark.parametrize("leaves", [1, 9, 70])
def test_zero_bits_in_the_updates_change_nothing(make, leaves):
    """The in-place ordering reads one element of each update leaf; here
    every update's first element is +0.0 (all bits clear: its gradient
    entry is 0 in every step). The emitted updates still equal plain optax
    on the window means (Lion's momentum, written over its old value after
    the updates read it, included), and the accumulator holds the window's
    mean at every emit (zeros as optax holds it: `optax_state`), with 1
    leaf, a group of 8 reads and more, and nested groups."""
    rng = np.random.default_rng(leaves)
    k, n_steps = 2, 8
    grads = rng.normal(size=(n_steps, leaves, 3)).astype(np.float32)
    grads[:, :, 0] = 0.0
    opt = optax_ext.MultiSteps(make(), every_k_schedule=k)
    params = {f"w{i:02d}": jnp.zeros(3) for i in range(leaves)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    want = [
        _reference_run(make, list(grads[:, i]), lambda _: k, True)
        for i in range(leaves)
    ]
    for t in range(n_steps):
        g = {f"w{i:02d}": jnp.asarray(grads[t, i]) for i in range(leaves)}
        u, state = step(g, state, params)
        for i in range(leaves):
            np.testing.assert_allclose(
                to_np(u[f"w{i:02d}"]), want[i][t], rtol=1e-6, atol=1e-7
            )
            assert to_np(u[f"w{i:02d}"])[0] == 0.0
        if (t + 1) % k == 0:
            for i in range(leaves):
                np.testing.assert_allclose(
                    to_np(state.acc_grads[f"w{i:02d}"]),
                    grads[t + 1 - k : t + 1, i].astype(np.float64).mean(0),
                    rtol=1e-6,
                    atol=1e-7,
                )
            assert_exact_zeros(opt.optax_state(state).acc_grads)


def test_has_updated_and_counters():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=3)
    params = jnp.zeros(2)
    state = opt.init(params)
    seen = []
    for _ in range(7):
        _, state = opt.update(jnp.ones(2), state, params)
        seen.append(
            (
                bool(opt.has_updated(state)),
                int(state.mini_step),
                int(state.gradient_step),
            )
        )
    assert seen == [
        (False, 1, 0), (False, 2, 0), (True, 0, 1),
        (False, 1, 1), (False, 2, 1), (True, 0, 2), (False, 1, 2),
    ]  # fmt: skip


# --- should_skip_update_fn -----------------------------------------------------


def test_skip_not_finite_drops_the_mini_step(window_form):
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=3, should_skip_update_fn=optax.skip_not_finite
    )
    opt = window_form(opt)
    params = jnp.zeros(2)
    state = opt.init(params)
    grads = [[1.0, 2.0], [nan, 0.0], [3.0, 4.0], [inf, 1.0], [5.0, 9.0]]
    outs = []
    for g in grads:
        u, state = opt.update(jnp.array(g), state, params)
        outs.append(to_np(u))
        assert np.isfinite(to_np(state.acc_grads)).all()
    assert int(state.skip_state["num_not_finite"]) == 0
    for i in range(4):
        assert_exact_zeros(jnp.asarray(outs[i]))
    np.testing.assert_allclose(outs[4], -np.mean([[1, 2], [3, 4], [5, 9]], axis=0))
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 0


def test_skip_state_records_decision():
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
    )
    state = opt.init(jnp.zeros(2))
    _, state = opt.update(jnp.array([nan, inf]), state)
    assert bool(state.skip_state["should_skip"])
    assert int(state.skip_state["num_not_finite"]) == 2
    assert int(state.mini_step) == 0


# --- extra arguments, state type and checkpoints -------------------------------


def _scale_by_value():
    def update(updates, state, params=None, *, value):
        return jax.tree.map(lambda u: u * value, updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_extra_args_reach_the_inner_optimizer():
    opt = optax_ext.MultiSteps(_scale_by_value(), every_k_schedule=2)
    state = opt.init(jnp.zeros(2))
    u, state = opt.update(jnp.array([1.0, 2.0]), state, value=jnp.float32(5.0))
    assert_exact_zeros(u)
    u, state = jax.jit(opt.update)(
        jnp.array([3.0, 4.0]), state, value=jnp.float32(10.0)
    )
    np.testing.assert_allclose(to_np(u), [20.0, 30.0])


@pytest.mark.parametrize("stop", [1, 2, 3, 4, 5], ids=lambda n: f"after {n}")
@pytest.mark.parametrize("use_grad_mean", [True, False], ids=["mean", "sum"])
def test_state_moves_between_optax_and_optax_ext(use_grad_mean, stop):
    """A state moved at any step, mid-window or at a window's end, goes on
    to the same updates as staying: from optax_ext to optax.MultiSteps
    through `optax_state` (optax's first fold adds to what `acc_grads`
    holds: `acc + (g - acc) / 1`, or `acc + g`), and from optax's as it
    is. The reference is optax.MultiSteps alone, jitted as the others."""
    kw = dict(every_k_schedule=3, use_grad_mean=use_grad_mean)
    ours = optax_ext.MultiSteps(optax.sgd(1.0), **kw)
    theirs = optax.MultiSteps(optax.sgd(1.0), **kw)
    rng = np.random.default_rng(stop)
    # Large values, so that `acc + (g - acc)` would not give `g` back.
    grads = [jnp.asarray(x) for x in rng.normal(size=(9, 4)).astype(np.float32) * 1e4]
    p = jnp.zeros(4)

    def run(first, second, convert):
        step1, step2 = jax.jit(first.update), jax.jit(second.update)
        s, out = first.init(p), []
        for t, g in enumerate(grads):
            if t == stop:
                s = convert(s)
            u, s = (step1 if t < stop else step2)(g, s, p)
            out.append(np.asarray(u))
        return np.stack(out)

    want = run(theirs, theirs, lambda s: s)
    to_optax = run(ours, theirs, jax.jit(ours.optax_state))
    from_optax = run(theirs, ours, lambda s: s)
    np.testing.assert_array_equal(to_optax, want)
    np.testing.assert_array_equal(from_optax, want)
    if stop % 3 == 0:  # at a window's end optax_ext holds the window's mean
        unconverted = run(ours, theirs, lambda s: s)
        assert not np.array_equal(unconverted, want)


def _nested(lib, inject, mean):
    """Optimizers with a `MultiSteps` inside another's inner state, built
    from `lib`'s `MultiSteps` and `inject`'s `inject_hyperparams`."""
    ms = lambda opt, k: lib.MultiSteps(opt, every_k_schedule=k, use_grad_mean=mean)
    return {
        "nested": ms(ms(optax.sgd(1.0), 2), 2),
        "three deep": ms(
            optax.chain(optax.scale(1.0), ms(ms(optax.sgd(1.0), 2), 2)), 2
        ),
        "chain": ms(optax.chain(optax.scale(0.5), ms(optax.sgd(1.0), 3)), 2),
        "skip_when": ms(optax_ext.skip_when(ms(optax.sgd(1.0), 2)), 2),
        "inject_hyperparams": ms(
            inject(lambda learning_rate: ms(optax.sgd(learning_rate), 2))(
                learning_rate=1.0
            ),
            2,
        ),
    }


@pytest.mark.parametrize(
    "case", ["nested", "three deep", "chain", "skip_when", "inject_hyperparams"]
)
@pytest.mark.parametrize("use_grad_mean", [True, False], ids=["mean", "sum"])
def test_optax_state_converts_every_nested_multi_steps_state(case, use_grad_mean):
    """`optax_state` zeroed only the outer accumulator: a nested MultiSteps
    that had just emitted kept its window's mean (or sum), and
    optax.MultiSteps added it into its next window (after a spike, -0.5
    where optax alone gives -1.0). Moved to optax at every step, the run
    goes on to optax alone's updates bit for bit, jitted as they are."""
    ours = _nested(optax_ext, optax_ext.inject_hyperparams, use_grad_mean)[case]
    theirs = _nested(optax, optax.inject_hyperparams, use_grad_mean)[case]
    # A spike mid-run: `acc + (g - acc)` after it does not give `g` back.
    grads = [jnp.full(2, v, jnp.float32) for v in [1.0] * 8 + [1e8] * 8 + [1.0] * 16]
    p = jnp.zeros(2)

    step_ours, step_theirs = jax.jit(ours.update), jax.jit(theirs.update)
    to_optax = jax.jit(ours.optax_state)

    def run(cut):
        s, out = (ours if cut else theirs).init(p), []
        for t, g in enumerate(grads):
            if t == cut and cut:
                s = to_optax(s)
            u, s = (step_ours if t < cut else step_theirs)(g, s, p)
            out.append(u)
        return np.stack(jax.device_get(out))

    want = run(0)  # optax alone
    assert np.any(want != 0)
    for cut in range(1, len(grads)):
        np.testing.assert_array_equal(run(cut), want, err_msg=f"moved at step {cut}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_state_is_interchangeable_with_optax(dtype):
    params = {"a": jnp.ones((3, 2), dtype), "b": jnp.ones(2, dtype)}
    ours = optax_ext.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    theirs = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    assert type(s_ours) is optax.MultiStepsState
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    assert avals(s_ours) == avals(s_theirs)
    rng = np.random.default_rng(0)
    g1, g2 = (
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), dtype), params)
        for _ in range(2)
    )
    # A state written by optax continues under optax_ext, and the reverse:
    # both keep optax's float32 running mean, so the updates are bit-equal
    # (this compared at rtol 1e-2 with equal gradients, which hid any
    # difference in the mean).
    # Both jitted: bit for bit in bfloat16 holds between like forms on
    # XLA:CPU; elsewhere within the bound of one adam step on the mean (about
    # 20 roundings, with room), the two programs being compiled apart.
    ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
    _, s1 = theirs_update(g1, s_theirs, params)
    u_ours, _ = ours_update(g2, s1, params)
    _, s2 = ours_update(g1, s_ours, params)
    u_theirs, _ = theirs_update(g2, s2, params)
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs), strict=True):
        assert a.dtype == b.dtype == dtype
        if dtype == jnp.float32:
            np.testing.assert_array_equal(to_np(a), to_np(b))
    if dtype != jnp.float32:
        assert_close_across_programs(u_ours, u_theirs, ops=32)
    assert ours.inner_opt.init is not None
    tx = ours.gradient_transformation()
    assert isinstance(tx, optax.GradientTransformation)
    assert avals(tx.init(params)) == avals(s_ours)


# --- Equinox ----------------------------------------------------------------


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.relu, key=jax.random.key(0))


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@pytest.mark.parametrize(
    "impl", [OURS, upstream("non-array leaves (equinox #590)", raises=TypeError)]
)
def test_whole_equinox_model_as_params(impl):
    model = _mlp()
    xs = jax.random.normal(jax.random.key(1), (4, 5, 3))
    opt = impl(optax.adam(1e-2), every_k_schedule=2)
    state = opt.init(model)
    ref = optax.adam(1e-2)
    arrays = eqx.filter(model, eqx.is_array)
    ref_state = ref.init(arrays)
    update = eqx.filter_jit(opt.update)
    for i in range(4):
        grads = eqx.filter_grad(_loss)(model, xs[i])
        assert any(
            g is None for g in jax.tree.leaves(grads, is_leaf=lambda x: x is None)
        )
        updates, state = update(grads, state, model)
        if i % 2 == 1:
            prev = eqx.filter_grad(_loss)(model, xs[i - 1])
            mean = jax.tree.map(lambda a, b: (a + b) / 2, prev, grads)
            want, ref_state = ref.update(mean, ref_state, arrays)
            for a, b in zip(
                jax.tree.leaves(updates), jax.tree.leaves(want), strict=True
            ):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        else:
            assert_exact_zeros(updates)
        model = eqx.apply_updates(model, updates)


def test_train_step_compiles_once():
    model = _mlp()
    opt = optax_ext.MultiSteps(
        optax.chain(optax_ext.zero_nans(), optax.adamw(1e-2)), every_k_schedule=3
    )
    state = opt.init(model)
    traces = []

    @eqx.filter_jit
    def step(model, state, x):
        traces.append(None)
        grads = eqx.filter_grad(_loss)(model, x)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    x = jax.random.normal(jax.random.key(2), (5, 3))
    before = _loss(model, x)
    for i in range(30):
        xi = x.at[0, 0].set(nan) if i == 7 else x
        model, state = step(model, state, xi)
    assert len(traces) == 1
    assert _loss(model, x) < before
    assert all(
        jnp.isfinite(p).all() for p in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    )


# --- errors ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", False, None, [2]])
def test_every_k_schedule_is_validated(bad):
    with pytest.raises((TypeError, ValueError), match="every_k_schedule"):
        optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=bad)


def _never(step):
    return step < 0  # traced False under jit: never emits, as in optax


@pytest.mark.parametrize(
    "every_k",
    [
        True,
        lambda step: True,
        lambda step: np.bool_(True),
        lambda step: step >= 0,
        _never,
    ],
    ids=["True", "returns-True", "returns-np.True_", "step>=0", "step<0"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bool_every_k_schedule_as_optax(every_k, jit):
    """Issue 26: a bool `every_k_schedule` (or a schedule returning one) was
    refused; optax takes it as the int it is (`True` is 1)."""
    grads = [jnp.asarray([0.5, -1.0]), jnp.asarray([2.0, 0.25]), jnp.ones(2)]

    def trajectory(opt):
        update = jax.jit(opt.update) if jit else opt.update
        params, state, out = jnp.zeros(2), opt.init(jnp.zeros(2)), []
        for g in grads:
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append(np.asarray(params))
        return np.stack(out)

    expected = trajectory(optax.MultiSteps(optax.sgd(0.5), every_k))
    opt = optax_ext.MultiSteps(optax.sgd(0.5), every_k)
    if every_k is _never and not jit:
        # Known while tracing, False is refused as 0 is (optax never emits).
        with pytest.raises(ValueError, match="every_k_schedule returned False"):
            trajectory(opt)
        return
    np.testing.assert_array_equal(trajectory(opt), expected)


def test_numpy_int_every_k_is_accepted():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=np.int64(2))
    state = opt.init(jnp.zeros(1))
    _, state = opt.update(jnp.ones(1), state)
    _, state = opt.update(jnp.ones(1), state)
    assert bool(opt.has_updated(state))


def test_inner_must_be_a_gradient_transformation():
    with pytest.raises(TypeError, match="GradientTransformation"):
        optax_ext.MultiSteps(optax.adam, every_k_schedule=2)


@pytest.mark.parametrize(
    "fn",
    [
        lambda u, s, p: (jnp.array(0), ()),
        lambda u, s, p: (jnp.zeros(2, bool), ()),
        lambda u, s, p: (jnp.float32(0.0), ()),
        lambda u, s, p: jnp.array(False),
    ],
    ids=["int", "vector", "float", "not-a-pair"],
)
def test_should_skip_must_return_scalar_bool(fn):
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=fn)
    with pytest.raises(TypeError, match="should_skip_update_fn"):
        jax.jit(opt.init)(jnp.zeros(2))


@pytest.mark.parametrize("fn", [3, "skip_not_finite"])
def test_should_skip_update_fn_that_is_not_a_function_is_refused_at_construction(fn):
    """Not at the first step, inside `jit`, as "object is not callable"."""
    with pytest.raises(TypeError, match=r"should_skip_update_fn must be None or a fun"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=fn)


@pytest.mark.parametrize("skip", [True, False])
def test_should_skip_may_return_a_python_bool(skip):
    """A skip function deciding on the host (a Python bool, as a schedule
    of skipped steps would) is as good as a traced one."""
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 1, should_skip_update_fn=lambda u, s, p: (skip, ())
    )
    state = opt.init(jnp.zeros(2))
    updates, state = jax.jit(opt.update)(jnp.ones(2), state)
    np.testing.assert_array_equal(to_np(updates), [0.0, 0.0] if skip else [-1.0, -1.0])
    assert int(state.gradient_step) == (0 if skip else 1)


def test_mismatched_grads_name_the_path():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    params = {"layer": {"w": jnp.zeros(2), "b": jnp.zeros(1)}}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"\['layer'\]\['b'\]"):
        jax.jit(opt.update)({"layer": {"w": jnp.zeros(2)}}, state)
    with pytest.raises(ValueError, match=r"\['layer'\]\['w'\]"):
        opt.update({"layer": {"w": None, "b": jnp.zeros(1)}}, state)
    with pytest.raises(ValueError, match=r"\['extra'\]"):
        opt.update({"layer": params["layer"], "extra": jnp.zeros(1)}, state)


def test_vmap_over_independent_windows():
    """Batched states (the `cond` becomes a select) give, member by member,
    what unbatched runs give, NaN isolation included."""
    opt = optax_ext.MultiSteps(
        optax.chain(optax_ext.zero_nans(), optax.adam(0.1)), every_k_schedule=3
    )
    params = jnp.zeros(2)
    grads = jnp.array(
        [[[1.0, 2.0], [nan, 1.0], [3.0, 3.0], [1.0, 1.0]],
         [[inf, 0.5], [2.0, 2.0], [0.5, 1.0], [2.0, 1.0]]]
    )  # fmt: skip
    # Member 1 starts one mini-step into its window.
    states = [opt.init(params), opt.update(grads[1, 0], opt.init(params), params)[1]]
    batched = jax.tree.map(lambda a, b: jnp.stack([a, b]), *states)
    step = jax.jit(jax.vmap(opt.update, in_axes=(0, 0, None)))
    one = jax.jit(opt.update)  # jitted as `step` is: compared bit for bit
    for t in range(1, 4):
        got, batched = step(grads[:, t], batched, params)
        for m in range(2):
            want, states[m] = one(grads[m, t], states[m], params)
            np.testing.assert_array_equal(to_np(got[m]), to_np(want))
    assert avals(jax.tree.map(lambda x: x[0], batched)) == avals(states[0])


def test_wrong_gradient_shapes_name_the_path():
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    state = opt.init({"w": jnp.zeros(3)})
    for bad in [jnp.zeros(()), jnp.zeros((4, 3)), jnp.zeros(2)]:
        with pytest.raises(ValueError, match=r"\['w'\].*shape"):
            jax.jit(opt.update)({"w": bad}, state)


@pytest.mark.parametrize(
    "schedule, error",
    [(lambda step: 0, ValueError), (lambda step: jnp.ones(2, jnp.int32), TypeError)],
    ids=["zero", "vector"],
)
def test_every_k_schedule_output_is_checked(schedule, error):
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=schedule)
    with pytest.raises(error, match="every_k_schedule"):
        opt.update(jnp.ones(2), opt.init(jnp.zeros(2)))


def test_python_float_params_train_as_in_optax():
    """Issue 13: a Python float leaf in params was rejected; optax accepts it
    (and a Python float gradient). The updates equal optax's, jitted
    alike."""
    params = {"s": 0.5, "w": jnp.zeros(2)}
    grads = [{"s": 1.0, "w": jnp.array([1.0, 2.0])}, {"s": 2.0, "w": jnp.ones(2)}]
    outs = {}
    for impl in (optax_ext.MultiSteps, optax.MultiSteps):
        opt = impl(optax.adam(0.1), every_k_schedule=2)
        state = opt.init(params)
        for g in grads:
            u, state = jax.jit(opt.update)(g, state, params)
        outs[impl] = u
    ours, theirs = outs[optax_ext.MultiSteps], outs[optax.MultiSteps]
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(to_np(a), to_np(b))
    # apply_gradients: a Python number cannot pass through the cond; the
    # unfused path gives optax.apply_updates' result.
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=1)
    new, _ = optax_ext.apply_gradients(opt, grads[0], opt.init(params), params)
    np.testing.assert_array_equal(to_np(new["s"]), -0.5)


def test_scan_and_grad_through_update():
    """lax.scan over mini-steps equals a Python loop; the gradient of the
    emitted sgd(1) update with respect to each mini-step's gradients is -1/k."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=4)
    params = jnp.zeros(3)
    grads = jnp.arange(12.0).reshape(4, 3)

    def run(grads):
        def body(state, g):
            u, state = opt.update(g, state, params)
            return state, u

        return jax.lax.scan(body, opt.init(params), grads)[1]

    outs = jax.jit(run)(grads)
    np.testing.assert_allclose(outs[3], -grads.mean(axis=0))
    assert_exact_zeros(outs[:3])
    d = jax.grad(lambda g: jnp.sum(run(g)[3]))(grads)
    np.testing.assert_allclose(d, jnp.full((4, 3), -0.25))


@pytest.mark.parametrize("inner", ["adam", "sgd-nesterov"])
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_bfloat16_gradients_computed_in_the_step_fold_as_bfloat16(form, inner):
    """A bfloat16 gradient computed in the same jitted step is folded as the
    bfloat16 value it is. Fusing the gradient's computation into the fold,
    XLA may skip its rounding (its default excess precision): the
    accumulator then held float32 bits of the gradient (0x3fc19840 where
    the gradient is 0x3fc20000), which depended on what else the step
    computed, and `microbatched` and `MultiSteps` agreed only by chance."""
    kw, kv, kx = jax.random.split(jax.random.key(1), 3)
    params = {
        "w": jax.random.normal(kw, (3, 8), jnp.bfloat16),
        "b": jnp.zeros((8,), jnp.bfloat16),
        "v": jax.random.normal(kv, (8,), jnp.bfloat16),
    }
    x = jax.random.normal(kx, (8, 3), jnp.bfloat16)

    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) @ params["v"])

    make = {
        "adam": lambda: optax.adam(1e-2),  # in-place moments
        "sgd-nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    }[inner]
    opt = optax_ext.MultiSteps(make(), 4)

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(loss)(params, x)
        if form == "apply_gradients":
            return optax_ext.apply_gradients(opt, grads, state, params)
        return opt.update(grads, state, params)

    _, state = step(params, opt.init(params), x)
    want = jax.jit(jax.grad(loss))(params, x)  # returned, so rounded
    for name, acc in state.acc_grads.items():
        bits = np.asarray(acc).view(np.uint32)
        assert not (bits & 0xFFFF).any(), (name, [hex(b) for b in bits.ravel()])
    # The gradient itself is computed by two programs: bit for bit on
    # XLA:CPU; elsewhere within the bound of its rounding steps (forward:
    # a 3-long dot, bias, tanh, an 8-long dot, an 8-term mean; the backward
    # pass as many again: about 48).
    folded = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state.acc_grads)
    assert_close_across_programs(folded, want, ops=48)


def test_window_form_fixture_gives_each_form(window_form):
    """The `window_form` fixture the reference tests above take configures
    the drop-in's form: a conditional, or the inner optimizer on every
    step with its results selected (the form GPUs and TPUs run)."""
    opt = window_form(optax_ext.MultiSteps(optax.adam(1e-3), 3))
    params = jnp.zeros(5)
    compiled = jax.jit(opt.update).lower(params, opt.init(params), params).compile()
    conditionals = compiled.as_text().count(" conditional(")
    assert conditionals == (window_form.name == "conditional"), conditionals


@pytest.mark.parametrize("clear", [True, False], ids=["cleared", "kept"])
def test_a_window_starts_afresh_whatever_form_left_the_accumulator(window_form, clear):
    """One state through the fused step (its conditional keeps the window's
    mean in `acc_grads`, here a NaN one that the inner `zero_nans`
    cleans) and then `update` in each drop-in form: the next window folds
    from its first gradient, not from what was left (values of 1e4, where
    `acc + (g - acc)` is not `g`). Where the drop-in runs selected it
    clears the accumulator at a window's end, as optax.MultiSteps does, on
    a TPU (`cleared`); a GPU's keeps the window's mean (`kept`).
    Reference: sgd on each window's mean, float64, rounded once."""
    opt = optax_ext.MultiSteps(
        optax.chain(optax_ext.zero_nans(), optax.sgd(1.0)), every_k_schedule=2
    )
    opt = window_form(opt, clear=clear)
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(6, 3)).astype(np.float32) * 1e4 + 3.0
    grads[1, 0] = nan
    p = jnp.zeros(3)
    fused = jax.jit(lambda g, s, p: optax_ext.apply_gradients(opt, g, s, p))
    update = jax.jit(opt.update)
    s = opt.init(p)
    for g in grads[:2]:
        p, s = fused(jnp.asarray(g), s, p)
    assert not np.isfinite(to_np(s.acc_grads)[0])  # the fused step kept it
    want = np.zeros(3)
    want[1:] = -grads[:2, 1:].astype(np.float64).mean(0)
    for t, g in enumerate(grads[2:], start=2):
        u, s = update(jnp.asarray(g), s, p)
        p = optax.apply_updates(p, u)
        if t % 2:
            want = want - grads[t - 1 : t + 1].astype(np.float64).mean(0)
            np.testing.assert_allclose(to_np(p), want.astype(np.float32), rtol=1e-6)
            cleared = not np.any(to_np(s.acc_grads))
            assert cleared == (window_form.name == "every step" and clear)
