"""skip_when: skip the inner optimizer on steps decided by a traced flag."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    assert_close_across_programs,
    assert_exact_zeros,
    assert_python_leaves_kept,
    avals,
    model_grads,
    model_with_python_leaves,
    to_np,
)

import optax_ext

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


# Rounding steps on the path to an entry of one step of adam (moments, bias
# corrections, sqrt, eps, division, learning rate: about 20), with room.
ADAM_OPS = 32


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
    bare_update = jax.jit(bare.update)
    traces = []

    @jax.jit
    def step(grads, state, skip):
        traces.append(None)
        return opt.update(grads, state, params, skip=skip)

    taken = 0
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
            # Jitted, as `step` is: bit for bit in bfloat16 holds between
            # compiled forms on XLA:CPU, not against eager op-by-op rounding;
            # elsewhere bfloat16 is within the bound of `taken` adam steps.
            want, ref_state = bare_update(grads, ref_state, params)
            taken += 1
            if dtype == jnp.float32:
                _bits_equal(updates, want)
            else:
                assert_close_across_programs(updates, want, ops=taken * ADAM_OPS)
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


def _bits_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(to_np(a), to_np(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_without_the_flag_the_step_runs_as_the_bare_optimizer(dtype):
    """Issue 13: the flag was required on every update; without it the step is
    not skipped (the documented default), bit for bit the bare optimizer
    (bfloat16: on XLA:CPU; elsewhere within the bound of the steps taken)."""
    params = _params(dtype)
    opt = optax_ext.skip_when(optax.adam(1e-2))
    bare = optax.adam(1e-2)
    state, ref_state = opt.init(params), bare.init(params)
    for i in range(3):
        grads = _grads(params, 0.1 * (i + 1))
        u, state = jax.jit(opt.update)(grads, state, params)
        want, ref_state = jax.jit(bare.update)(grads, ref_state, params)
        if dtype == jnp.float32:
            _bits_equal(u, want)
            _bits_equal(state, ref_state)
        else:
            ops = (i + 1) * ADAM_OPS
            assert_close_across_programs(u, want, ops=ops, err_msg=f"step {i}")
            assert_close_across_programs(state, ref_state, ops=ops)


def test_flax_train_state_apply_gradients():
    """flax's TrainState.apply_gradients passes no extra argument to
    tx.update: skip_when must work there, as the bare optimizer does."""
    train_state = pytest.importorskip("flax.training.train_state")
    params = _params()

    def run(tx):
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
        for i in range(3):
            state = step(state, _grads(params, 0.5 - 0.1 * i))
        return state

    got = run(optax_ext.skip_when(optax.adamw(1e-2)))
    want = run(optax.adamw(1e-2))
    _bits_equal(got.params, want.params)
    _bits_equal(got.opt_state, want.opt_state)


def test_flax_nnx_optimizer_passes_the_flag():
    """nnx.Optimizer.update forwards keyword arguments to tx.update: the flag
    skips there, and its absence does not."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax_ext.skip_when(optax.sgd(0.5)), wrt=nnx.Param)

    def values():  # a copy: nnx.state's leaves follow the model
        return [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

    before = values()
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads, skip=jnp.asarray(True))
    for a, b in zip(values(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    optimizer.update(model, grads)
    for a, b in zip(values(), before, strict=True):
        np.testing.assert_array_equal(a, b - np.float32(0.5))


def _f32(x):
    return float(np.float32(x))


def _wrapped_adam_and_reference(wrap):
    """The optimizer under test and plain optax computing the same thing:
    skip_when(adam) is adam; injected hyperparameters are float32 values, so
    inject_hyperparams(adam) is adam given the float32-rounded numbers (what
    docs/inject_hyperparams.md states)."""
    if wrap == "skip_when":
        return optax_ext.skip_when(optax.adam(1e-2)), optax.adam(1e-2)
    opt = optax_ext.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    bare = optax.adam(_f32(1e-2), b1=_f32(0.9), b2=_f32(0.999), eps=_f32(1e-8))
    return opt, bare


@pytest.mark.parametrize("wrap", ["skip_when", "inject_hyperparams"])
@pytest.mark.parametrize("jit", [False, True])
def test_python_float_param_as_optax(wrap, jit):
    """Issue 13: a Python float leaf in params raised TypeError ('NoneType')
    with inject_hyperparams and skip_when; optax optimises it. Reference:
    plain optax.adam, bit for bit (values, dtypes and weak types)."""
    params = {"w": jnp.array([1.0, -2.0]), "s": 0.5}
    opt, bare = _wrapped_adam_and_reference(wrap)
    # Compiled and eager arithmetic may differ by an ulp (XLA fuses): the
    # reference runs the way the tested update does (without a flag,
    # skip_when runs its inner update as it is, with no lax.cond).
    update = jax.jit(opt.update) if jit else opt.update
    bare_update = jax.jit(bare.update) if jit else bare.update
    state, ref_state = opt.init(params), bare.init(params)
    for i in range(3):
        grads = jax.grad(lambda p, i=i: jnp.sum(p["w"] ** 2) * p["s"] ** (i + 1))(
            params
        )
        u, state = update(grads, state, params)
        want, ref_state = bare_update(grads, ref_state, params)
        assert avals(u) == avals(want)
        _bits_equal(u, want)
        params = optax.apply_updates(params, u)


@pytest.mark.parametrize("wrap", ["skip_when", "inject_hyperparams"])
def test_equinox_float_field_without_gradient(wrap):
    """An Equinox model's Python float field (Dropout's p) gets a None gradient
    from eqx.filter_grad while optax-style init keeps state for it: the step
    still runs, returns None there and matches adam on the array leaves."""
    import equinox as eqx

    class Model(eqx.Module):
        w: jax.Array
        p: float
        act: object = jax.nn.relu

    model = Model(jnp.array([1.0, -2.0]), 0.5)
    opt, bare = _wrapped_adam_and_reference(wrap)
    state = opt.init(model)
    grads = eqx.filter_grad(lambda m: jnp.sum(m.act(m.w) * 3.0))(model)
    assert grads.p is None
    u, state = eqx.filter_jit(opt.update)(grads, state, model)
    assert u.p is None and u.act is None
    # The reference sees the tree the inner optimizer sees: p with a zero.
    # Compiled programs of different trees may round the last bit apart
    # (measured: 1 ulp between eqx.filter_jit of this and jax.jit of adam).
    p, g = {"w": model.w, "p": 0.5}, {"w": grads.w, "p": 0.0}
    want, _ = jax.jit(bare.update)(g, bare.init(p), p)
    assert u.w.dtype == want["w"].dtype
    np.testing.assert_array_max_ulp(np.asarray(u.w), np.asarray(want["w"]), maxulp=1)


# Inner optimizers of `skip_when` for an Equinox model: adamw's weight decay
# gives `Dropout.p` (optimised, with no gradient) a non-zero inner update,
# which the step must not apply; MultiSteps accumulates a zero for it.
DROPOUT_INNER = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.5),
    "MultiSteps(adam, 1)": lambda: optax_ext.MultiSteps(optax.adam(1e-2), 1),
}


@pytest.mark.parametrize("inner", DROPOUT_INNER)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_equinox_dropout_none_gradient_over_any_inner(inner, jit, fused):
    """Issue 40: for a model with an `eqx.nn.Dropout` (a Python float `p`
    whose `eqx.filter_grad` gradient is `None`), `apply_gradients` of
    `skip_when(adam)` raised a pytree structure error, eagerly and jitted
    with a traced `skip` (`skip_when(MultiSteps(adam, 1))`: on the
    accumulator): the inner step got the gradients without the zero that
    `update` gives it for `p`, against a state holding `p`'s moments.
    Reference: the inner optimizer (without MultiSteps, k=1) on the model's
    arrays, then `eqx.apply_updates`, on the steps not skipped."""
    opt = optax_ext.skip_when(DROPOUT_INNER[inner]())
    bare = DROPOUT_INNER["adam" if inner.startswith("MultiSteps") else inner]()

    def step(model, state, grads, skip):
        if fused:
            return optax_ext.apply_gradients(opt, grads, state, model, skip=skip)
        updates, state = opt.update(grads, state, model, skip=skip)
        return eqx.apply_updates(model, updates), state

    def reference(model, state, grads):
        arrays = eqx.filter(model, eqx.is_inexact_array)
        updates, state = bare.update(grads, state, arrays)
        return eqx.apply_updates(model, updates), state

    step = eqx.filter_jit(step) if jit else step
    reference = eqx.filter_jit(reference) if jit else reference
    model = want = model_with_python_leaves()
    state = opt.init(model)
    ref_state = bare.init(eqx.filter(model, eqx.is_inexact_array))
    for i, skip in enumerate([False, True, False]):
        grads = model_grads(model, i)
        assert grads.dropout.p is None
        model, state = step(model, state, grads, jnp.asarray(skip) if jit else skip)
        if not skip:
            want, ref_state = reference(want, ref_state, model_grads(want, i))
        assert_python_leaves_kept(model, want)
        for a, b in zip(
            jax.tree.leaves(eqx.filter(model, eqx.is_array)),
            jax.tree.leaves(eqx.filter(want, eqx.is_array)),
            strict=True,
        ):
            # Compiled (or run) apart: an ulp apart at most.
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("skip", [False, True])
def test_fused_step_keeps_a_weak_float_given_no_gradient(skip):
    """Issue 40: a Python float param under `jax.jit` (a weakly typed array)
    given a `None` gradient. `update` hands the inner optimizer a zero for
    it and gives it a `None` update, so `eqx.apply_updates` keeps it; fused,
    the inner step got the `None` against the float's moments (a pytree
    structure error), and must not apply the inner update of the zero
    either (adamw's weight decay would move it from 0.5 to 0.475).
    Reference: `update` + `eqx.apply_updates`."""
    opt = optax_ext.skip_when(optax.adamw(0.1, weight_decay=0.5))
    params = {"w": jnp.array([1.0, -2.0]), "p": 0.5}
    grads = {"w": jnp.array([0.5, 0.25]), "p": None}

    @jax.jit
    def fused(params, state, skip):
        return optax_ext.apply_gradients(opt, grads, state, params, skip=skip)

    @jax.jit
    def reference(params, state, skip):
        updates, state = opt.update(grads, state, params, skip=skip)
        return eqx.apply_updates(params, updates), state

    state = opt.init(params)
    got = fused(params, state, jnp.asarray(skip))
    want = reference(params, state, jnp.asarray(skip))
    assert float(got[0]["p"]) == 0.5
    assert avals(got) == avals(want)
    np.testing.assert_allclose(got[0]["w"], want[0]["w"], rtol=1e-6)
    assert_close_across_programs(got[1], want[1], ops=ADAM_OPS)


@pytest.mark.parametrize("wrap", ["skip_when", "inject_hyperparams"])
@pytest.mark.parametrize("form", ["equinox", "jax.jit"])
def test_python_float_param_state_keeps_its_avals(wrap, form):
    """A Python float leaf (an Equinox model's `Dropout.p`; under `jax.jit` a
    weakly typed tracer) gets state that update returns with init's avals,
    so the jitted train step compiles once. Built from the number itself,
    adam's second moment was weak at init and strong after update: two
    compiles. Reference for the values: adam on the same leaves as strongly
    typed float32 arrays."""
    import equinox as eqx

    class Model(eqx.Module):
        w: jax.Array
        p: float

    opt, bare = _wrapped_adam_and_reference(wrap)
    traces = 0
    if form == "equinox":
        params = Model(jnp.array([1.0, -2.0]), 0.5)

        @eqx.filter_jit
        def step(params, state):
            nonlocal traces
            traces += 1
            grads = eqx.filter_grad(lambda m: jnp.sum(m.w**2) * 3.0)(params)
            u, state = opt.update(grads, state, params)
            return eqx.apply_updates(params, u), state, u

    else:
        params = {"w": jnp.array([1.0, -2.0]), "p": 0.5}

        @jax.jit
        def step(params, state):
            nonlocal traces
            traces += 1
            grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) * p["p"] * 6.0)(params)
            u, state = opt.update(grads, state, params)
            return params, state, u  # params kept: their weak type is the user's

    state = opt.init(params)
    ref_params = {"w": jnp.array([1.0, -2.0]), "p": jnp.float32(0.5)}
    ref_state = bare.init(ref_params)
    for _ in range(3):
        params, new_state, u = step(params, state)
        assert avals(new_state) == avals(state)
        state = new_state
        ref_grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) * p["p"] * 6.0)(ref_params)
        if form == "equinox":
            ref_grads["p"] = jnp.zeros((), jnp.float32)
        want, ref_state = jax.jit(bare.update)(ref_grads, ref_state, ref_params)
        got_w = u.w if form == "equinox" else u["w"]
        # Compiled apart, the steps may round an ulp apart, and the params
        # carry it into the next gradients.
        np.testing.assert_allclose(got_w, want["w"], rtol=1e-6)
        ref_params = {"w": ref_params["w"] + want["w"], "p": ref_params["p"]}
        if form == "jax.jit":
            params = {"w": params["w"] + u["w"], "p": 0.5}
            np.testing.assert_allclose(u["p"], want["p"], rtol=1e-6)
    assert traces == 1


P3 = {"w": jnp.ones(3)}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda sw: sw.update(P3, optax.sgd(0.1, momentum=0.9).init(P3), P3),
            TypeError,
            r"skip_when\.update's `state` does not have the structure of the inner "
            r"optimizer's state: got .*TraceState.*expected .*ScaleByAdamState",
        ),
        (
            lambda sw: sw.update(P3, None, P3),
            TypeError,
            r"skip_when\.update's `state` does not have the structure",
        ),
        (
            lambda sw: sw.update({"v": jnp.ones(3)}, sw.init(P3), P3),
            ValueError,
            r"skip_when\.update: The tree of the updates does not match the "
            r"params: the updates have nothing at \['w'\]",
        ),
        (
            lambda sw: sw.update(P3, sw.init(P3), P3, skip="yes"),
            TypeError,
            r"skip must be a scalar bool \(True skips the step; leave it out, "
            r"or pass False, to run it\), got 'yes'",
        ),
        (
            lambda sw: sw.update(P3, sw.init(P3), P3, skip=None),
            TypeError,
            r"skip must be a scalar bool .*, got None",
        ),
        (
            lambda sw: optax_ext.apply_gradients(sw, P3, None, P3),
            TypeError,
            r"optax_ext\.apply_gradients's `opt_state` does not have the structure",
        ),
        (
            lambda sw: optax_ext.apply_gradients(optax.adam, P3, None, P3),
            TypeError,
            r"optimizer must be an optax\.GradientTransformation.*"
            r"must be called to build one",
        ),
    ],
)
def test_bad_input_is_named(call, error, match):
    """Each of these failed deep inside optax or JAX (AttributeError on
    `mu`, `len(None)`, a pytree structure error naming no argument)."""
    with pytest.raises(error, match=match):
        call(optax_ext.skip_when(optax.adam(0.1)))


def test_checks_accept_none_gradients_an_inner_optimizer_takes():
    """The state and tree checks refuse no valid input: `optax.masked` takes a
    `None` gradient for a frozen leaf. Reference: the masked optimizer
    unwrapped."""
    params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([3.0])}
    grads = {"a": jnp.array([0.5, 0.25]), "b": None}
    masked = optax.masked(optax.adam(0.1), {"a": True, "b": False})
    opt = optax_ext.skip_when(masked)
    u, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    want, _ = jax.jit(masked.update)(grads, masked.init(params), params)
    assert u["b"] is None and want["b"] is None
    np.testing.assert_array_equal(u["a"], want["a"])
    new, _ = optax_ext.apply_gradients(opt, grads, opt.init(params), params)
    np.testing.assert_allclose(new["a"], params["a"] + want["a"], rtol=1e-6)
    np.testing.assert_array_equal(new["b"], params["b"])


def test_state_check_does_not_blame_a_good_state_for_the_updates():
    """A `None` gradient for a floating leaf that adam cannot take: the state
    came from this optimizer's init, so the state check (made against the
    params when given) passes, and the error is the inner optimizer's."""
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    opt = optax_ext.skip_when(optax.adam(0.1))
    with pytest.raises(Exception) as raised:  # noqa: PT011 - adam's own error
        opt.update({"a": jnp.ones(2), "b": None}, opt.init(params), params)
    assert "does not have the structure" not in str(raised.value)


@pytest.mark.parametrize("wrap", ["skip_when", "inject_hyperparams"])
@pytest.mark.parametrize("outer", ["alone", "MultiSteps"])
def test_integer_param_leaf_is_left_as_it_is(wrap, outer):
    """An integer array in a dict of params (a step counter) holds `None` in
    the wrapper's state; its gradient (an int, or float0 from
    `jax.grad(..., allow_int=True)`) is not handed to the inner optimizer
    and its update is zero, so the param stays. Inside MultiSteps this
    failed: the state check blamed the state, then adam met a `None`
    moment. Reference for the float leaf: adam on the float leaves alone."""
    opt, bare = _wrapped_adam_and_reference(wrap)
    params = {"w": jnp.array([1.0, -2.0]), "step": jnp.asarray(3)}
    grads = {"w": jnp.array([0.5, 0.25]), "step": jnp.asarray(1)}
    k = 1 if outer == "alone" else 2
    if outer == "MultiSteps":
        opt = optax_ext.MultiSteps(opt, k)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for _ in range(k):
        u, state = update(grads, state, params)
    assert u["step"].dtype == jnp.int32 and int(u["step"]) == 0
    new = optax.apply_updates(params, u)
    assert new["step"].dtype == jnp.int32 and int(new["step"]) == 3
    want, _ = jax.jit(bare.update)(
        {"w": grads["w"]}, bare.init({"w": params["w"]}), {"w": params["w"]}
    )
    np.testing.assert_allclose(u["w"], want["w"], rtol=1e-6)
    if outer == "alone":
        float0 = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
        u, _ = jax.jit(opt.update)(float0, opt.init(params), params)
        assert u["step"].dtype == jax.dtypes.float0
