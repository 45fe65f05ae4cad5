"""inject_hyperparams: masks, schedules, numerics, hypergradients."""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import across_programs_exact, assert_close_across_programs, avals, to_np

import optax_ext


class Net(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return x @ self.w + self.b


def _net(dtype=jnp.float32):
    return Net(jnp.ones((3, 2), dtype), jnp.ones(2, dtype))


def _grads(net):
    return jax.tree.map(lambda p: jnp.full_like(p, 0.25), net)


SCHEDULE = optax.linear_schedule(1e-1, 1e-2, 5)


def _bool_net():
    return Net(True, False)  # a callable pytree: an Equinox model of bools


class MaskFn(eqx.Module):
    """A callable pytree whose leaves are all functions: optax.masked calls
    it with the params, as it does a function."""

    rule: Callable

    def __call__(self, params):
        return jax.tree.map(self.rule, params)


MASKS = {
    "eqx-model": _bool_net,
    "eqx-module-of-functions": lambda: MaskFn(lambda p: p.ndim == 2),
    "function": lambda: lambda params: jax.tree.map(lambda p: p.ndim == 2, params),
    "plain-pytree": lambda: jax.tree.map(lambda p: p.ndim == 2, _net()),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("jit", [False, True])
def test_masks_need_no_static_args(mask, jit):
    """optax #1373: an Equinox model as a weight-decay mask, no static_args."""
    net = _net()
    opt = optax_ext.inject_hyperparams(optax.adamw)(
        SCHEDULE, weight_decay=0.5, mask=MASKS[mask]()
    )
    # Injected numbers are float32 values (docs: Numerics): the reference is
    # adamw given b1, b2 and eps rounded to float32, bit for bit.
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    ref = optax.adamw(
        SCHEDULE,
        b1=f32(0.9),
        b2=f32(0.999),
        eps=f32(1e-8),
        weight_decay=0.5,
        mask=MASKS[mask](),
    )
    init = jax.jit(opt.init) if jit else opt.init
    update = jax.jit(opt.update) if jit else opt.update
    ref_update = jax.jit(ref.update) if jit else ref.update
    state, ref_state = init(net), ref.init(net)
    for _ in range(3):
        u, state = update(_grads(net), state, net)
        r, ref_state = ref_update(_grads(net), ref_state, net)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(r), strict=True):
            np.testing.assert_array_equal(a, b)
        net = eqx.apply_updates(net, u)
    # As in optax: the value used by the last update (step count 2).
    np.testing.assert_allclose(
        state.hyperparams["learning_rate"], SCHEDULE(2), rtol=1e-6
    )


def test_upstream_calls_an_equinox_mask_as_a_schedule():
    opt = optax.inject_hyperparams(optax.adamw)(SCHEDULE, mask=_bool_net())
    with pytest.raises((TypeError, ValueError)):  # Net called with the step count
        opt.init(_net())


def test_bf16_adam_equals_bare_adam():
    """upstream-optax.md item 7: b2=0.999 must not round to 1.0 first."""
    p = {"w": jnp.ones(4, jnp.bfloat16)}
    g = {"w": jnp.full(4, 0.1, jnp.bfloat16)}
    bare = optax.adam(1e-2)
    # Both jitted: bit for bit in bfloat16 holds between like forms on
    # XLA:CPU; elsewhere within the bound of one adam step (about 20
    # roundings, with room), the two programs being compiled apart.
    want = jax.jit(bare.update)(g, bare.init(p), p)[0]["w"]
    for impl, ok in [(optax_ext, True), (optax, False)]:
        o = impl.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        got = jax.jit(o.update)(g, o.init(p), p)[0]["w"]
        assert got.dtype == want.dtype
        if across_programs_exact():
            assert np.array_equal(to_np(got), to_np(want)) == ok, impl.__name__
        elif ok:
            assert_close_across_programs(got, want, ops=32)
        else:
            with pytest.raises(AssertionError):
                assert_close_across_programs(got, want, ops=32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_updates_dtype_equals_bare_with_schedule(dtype):
    """upstream-optax.md item 8: a schedule must not make updates float32."""
    net = _net(dtype)
    bare = optax.adamw(SCHEDULE)
    want = jax.eval_shape(bare.update, _grads(net), bare.init(net), net)[0]
    ours = optax_ext.inject_hyperparams(optax.adamw)(SCHEDULE)
    got = jax.eval_shape(ours.update, _grads(net), ours.init(net), net)[0]
    assert avals(got) == avals(want)
    theirs = optax.inject_hyperparams(optax.adamw)(SCHEDULE)
    upstream = jax.eval_shape(theirs.update, _grads(net), theirs.init(net), net)[0]
    assert (avals(upstream) == avals(want)) == (dtype == jnp.float32)


def test_state_stays_stable_under_jit():
    net = _net(jnp.bfloat16)
    opt = optax_ext.inject_hyperparams(optax.adamw)(SCHEDULE, mask=_bool_net())
    state = opt.init(net)
    traces = []

    @jax.jit
    def step(state, net):
        traces.append(None)
        return opt.update(_grads(net), state, net)

    for _ in range(5):
        u, new_state = step(state, net)
        assert avals(new_state) == avals(state)
        state = new_state
    assert len(traces) == 1


def test_hyperparams_are_writable():
    params = jnp.array([1.0, -2.0])
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=None)
    state = opt.init(params)
    state.hyperparams["learning_rate"] = 0.5
    u, state = jax.jit(opt.update)(jnp.array([1.0, 1.0]), state, params)
    np.testing.assert_allclose(u, [-0.5, -0.5])
    assert float(state.hyperparams["learning_rate"]) == 0.5


WRITTEN_LR_WRAPPERS = {
    "bare": lambda opt: opt,
    "MultiSteps": lambda opt: optax_ext.MultiSteps(opt, every_k_schedule=1),
    "skip_when": lambda opt: optax_ext.skip_when(opt),
    "MultiSteps(skip_when)": lambda opt: optax_ext.MultiSteps(
        optax_ext.skip_when(opt), every_k_schedule=1
    ),
}


def _injected(state):
    """The inject_hyperparams state inside `state` (wrappers keep it whole)."""
    while not hasattr(state, "hyperparams"):
        state = state.inner_opt_state
    return state


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("wrap", WRITTEN_LR_WRAPPERS)
def test_weakly_typed_value_written_into_the_state_comes_back_strong(wrap, form):
    """`state.hyperparams[name] = jnp.asarray(1e-2)` writes a weakly typed
    array where init stored a float32 one. The step taking it traces once
    more (its input avals changed), as with Optax; the state it returns has
    init's avals again, wrapped as bare: inside MultiSteps and skip_when the
    written weak type stayed in the state for good, so a checkpoint round
    trip (which makes it strong) retraced the step once more. Reference: Adam
    with learning rate 1 gives the direction, exact to scale."""
    opt = WRITTEN_LR_WRAPPERS[wrap](
        optax_ext.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    )
    direction = optax.adam(1.0)
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    grads = [{"w": jnp.array([0.3, -0.1, 2.0]) * (i + 1)} for i in range(4)]
    traces = []

    @jax.jit
    def step(params, state, g):
        traces.append(None)
        if form == "update":
            updates, state = opt.update(g, state, params)
            return optax.apply_updates(params, updates), state
        return optax_ext.apply_gradients(opt, g, state, params)

    state = opt.init(params)
    init_avals = avals(state)
    ref_params, ref_state = params, direction.init(params)
    for i, g in enumerate(grads):
        if i == 2:
            _injected(state).hyperparams["learning_rate"] = jnp.asarray(1e-2)
            assert _injected(state).hyperparams["learning_rate"].weak_type
        params, state = step(params, state, g)
        assert avals(state) == init_avals, f"step {i}"
        d, ref_state = direction.update(g, ref_state, ref_params)
        lr = jnp.float32(1e-2 if i >= 2 else 1e-3)
        ref_params = jax.tree.map(lambda p, u, lr=lr: p + lr * u, ref_params, d)
        np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6)
    assert len(traces) == 2


@pytest.mark.parametrize("wrap", [w for w in WRITTEN_LR_WRAPPERS if w != "bare"])
def test_inner_optimizer_reads_the_value_as_written(wrap):
    """The wrappers hand the inner optimizer the state as the user wrote it:
    with `optax.inject_hyperparams`, bfloat16 params and a weakly typed
    learning rate written into the state, the updates stay bfloat16, equal
    to the unwrapped optimizer's bit for bit on XLA:CPU (made strong before
    the step, the rate promoted them to float32). Only the state returned
    gets init's avals back."""
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.float32(1e-3))
    opt = WRITTEN_LR_WRAPPERS[wrap](inner)
    params = {"w": jnp.array([1.0, -2.0, 0.5], jnp.bfloat16)}
    grads = {"w": jnp.array([0.3, -0.1, 2.0], jnp.bfloat16)}
    state, bare_state = opt.init(params), inner.init(params)
    init_avals = avals(state)
    _injected(state).hyperparams["learning_rate"] = jnp.asarray(0.0137)
    bare_state.hyperparams["learning_rate"] = jnp.asarray(0.0137)
    updates, state = jax.jit(opt.update)(grads, state, params)
    want, _ = jax.jit(inner.update)(grads, bare_state, params)
    assert updates["w"].dtype == want["w"].dtype == jnp.bfloat16
    # Two programs: `-lr * g` rounds twice (once where XLA keeps the product
    # in float32 and rounds it to bfloat16 after).
    assert_close_across_programs(updates, want, ops=2)
    assert avals(state) == init_avals


def _scaling_by_a_python_float():
    """An inner optimizer whose state holds a Python float."""
    return optax.GradientTransformation(
        lambda params: {"s": 0.5},
        lambda updates, state, params=None: (
            jax.tree.map(lambda g: g * state["s"], updates),
            state,
        ),
    )


@pytest.mark.parametrize("wrap", [w for w in WRITTEN_LR_WRAPPERS if w != "bare"])
def test_weak_leaves_that_init_built_stay_weak(wrap):
    """A Python float in the inner state, and Adam's moments for a Python
    float param (weakly typed from init on), are what init built: nothing
    is made strong there, so bfloat16 gradients keep bfloat16 updates, as
    unwrapped, and the step traces once, also when an equal optimizer built
    afresh (which never ran init) steps the state."""
    for make, params in (
        (_scaling_by_a_python_float, {"w": jnp.ones(3, jnp.bfloat16)}),
        (lambda: optax.adam(1e-3), {"w": jnp.ones(3), "p": 0.5}),
    ):
        grads = jax.tree.map(lambda p: jnp.ones_like(jnp.asarray(p)), params)
        opt = WRITTEN_LR_WRAPPERS[wrap](make())
        state = opt.init(params)
        for stepper in (opt, WRITTEN_LR_WRAPPERS[wrap](make())):
            traces = []

            @jax.jit
            def step(state, grads, stepper=stepper, traces=traces, params=params):
                traces.append(None)
                return stepper.update(grads, state, params)

            for _ in range(3):
                updates, state = step(state, grads)
            assert len(traces) == 1, (make, wrap, stepper is opt)
        if make is _scaling_by_a_python_float:
            want, _ = make().update(grads, make().init(params), params)
            assert avals(updates) == avals(want)


@pytest.mark.parametrize(
    "learning_rate",
    [1e-3, jnp.float32(1e-3), jnp.asarray(1e-3), SCHEDULE],
    ids=["python-float", "strong-array", "weak-array", "schedule"],
)
def test_hyperparam_dtype_is_applied_as_in_optax(learning_rate):
    """With `hyperparam_dtype=jnp.bfloat16`, optax casts Python floats and
    weakly typed values but keeps a strongly typed array's dtype (what
    `jnp.float32(...)` and optax's schedules give); optax_ext rounded every
    float to bfloat16. Reference: optax.inject_hyperparams, bit for bit, in
    the stored values and in the updates."""
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    grads = {"w": jnp.array([0.3, -0.1, 2.0])}
    got_opt, want_opt = (
        impl.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.bfloat16)(learning_rate)
        for impl in (optax_ext, optax)
    )
    got_state, want_state = got_opt.init(params), want_opt.init(params)
    for _ in range(2):
        got, got_state = got_opt.update(grads, got_state, params)
        want, want_state = want_opt.update(grads, want_state, params)
        stored = got_state.hyperparams["learning_rate"]
        expected = want_state.hyperparams["learning_rate"]
        assert stored.dtype == expected.dtype, (stored.dtype, expected.dtype)
        np.testing.assert_array_equal(to_np(stored), to_np(expected))
        assert got["w"].dtype == want["w"].dtype
        np.testing.assert_array_equal(to_np(got["w"]), to_np(want["w"]))


def test_hypergradient_matches_hand_computation():
    """d/d lr of L(p - lr * g) is -g . grad L(p - lr * g); L = sum(x**2)/2."""
    p, g = jnp.array([1.0, -2.0, 3.0]), jnp.array([0.5, 0.25, -1.0])
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = opt.init(p)

    def loss_after_update(lr):
        s = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})
        u, _ = opt.update(g, s, p)
        return 0.5 * jnp.sum(optax.apply_updates(p, u) ** 2)

    lr = state.hyperparams["learning_rate"]
    new_p = p - 0.1 * g
    np.testing.assert_allclose(jax.grad(loss_after_update)(lr), -g @ new_p, rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss_after_update))(lr), -g @ new_p, rtol=1e-6
    )


def test_static_args_and_hyperparam_dtype_are_kept():
    p = jnp.ones(3)
    opt = optax_ext.inject_hyperparams(
        optax.adamw, static_args=("weight_decay", "b2"), hyperparam_dtype=jnp.bfloat16
    )(learning_rate=1e-2, weight_decay=1e-4)
    state = jax.jit(opt.init)(p)
    assert "weight_decay" not in state.hyperparams and "b2" not in state.hyperparams
    assert state.hyperparams["b1"].dtype == jnp.bfloat16
    assert not state.hyperparams["b1"].weak_type
    with pytest.raises(ValueError, match="not_an_arg"):
        optax_ext.inject_hyperparams(optax.adam, static_args=("b1", "not_an_arg"))


def _three_sgd_updates(opt):
    """The updates of three steps on a gradient of one: minus the learning rates."""
    p = jnp.zeros(1)
    state = opt.init(p)
    outs = []
    for _ in range(3):
        u, state = opt.update(jnp.ones(1), state, p)
        outs.append(float(u[0]))
    return outs


def test_stateful_schedule():
    class Halving(optax.schedules.StatefulSchedule):
        def init(self):
            return jnp.asarray(1.0)

        def update(self, state, **extra_args):
            return state / 2

        def __call__(self, state, **extra_args):
            return state

    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=Halving())
    assert _three_sgd_updates(opt) == [-1.0, -0.5, -0.25]


def _factory(
    learning_rate,
    count: int = 3,
    fn=jnp.sqrt,
    mask=None,
    flag: bool = False,
    name: str = "x",
    dtype=jnp.float32,
    tree_fn: "Callable[[optax.Params], Any]" = None,
):
    del count, fn, mask, flag, name, dtype, tree_fn
    return optax.sgd(learning_rate)


def test_classification_rule():
    """Each rule of the docstring, on one factory."""
    seen = {}

    def spy(*args, **kwargs):
        bound = inspect.signature(_factory).bind(*args, **kwargs)
        seen.update(bound.arguments)
        return _factory(*args, **kwargs)

    spy.__signature__ = inspect.signature(_factory, eval_str=True)
    opt = optax_ext.inject_hyperparams(spy)(
        learning_rate=lambda c: 0.1,
        count=5,
        fn=jnp.exp,
        mask=lambda params: params,
        flag=True,
        name="y",
        dtype=jnp.bfloat16,
        tree_fn=_net(),
    )
    state = opt.init(jnp.zeros(2))
    assert set(state.hyperparams) == {"learning_rate"}
    assert set(state.hyperparams_states) == {"learning_rate"}
    assert seen["count"] == 5 and seen["fn"] is jnp.exp and seen["flag"] is True
    assert seen["dtype"] is jnp.bfloat16 and isinstance(seen["tree_fn"], Net)
    # An int where the default is a float (or absent) is injected.
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=1)
    assert "learning_rate" in opt.init(jnp.zeros(2)).hyperparams


def test_checkpoint_round_trip_keeps_the_arithmetic():
    """Hyperparameters are stored strongly typed (weak types do not survive
    serialisation), so a restored state has the avals of the original; the
    updates must still be those of the bare alias (bfloat16, bit for bit on
    XLA:CPU; elsewhere within the bound of one adamw step)."""
    net = _net(jnp.bfloat16)
    opt = optax_ext.inject_hyperparams(optax.adamw)(SCHEDULE, b2=0.999)
    state = opt.init(net)
    restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)
    assert avals(restored) == avals(state)
    # Both jitted: bit for bit in bfloat16 holds between like forms on
    # XLA:CPU; elsewhere within the bound of one adamw step (about 22
    # roundings, with room).
    u, new_state = eqx.filter_jit(opt.update)(_grads(net), restored, net)
    bare = optax.adamw(SCHEDULE, b2=0.999)
    want, _ = eqx.filter_jit(bare.update)(_grads(net), bare.init(net), net)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
    assert_close_across_programs(
        eqx.filter(u, eqx.is_array), eqx.filter(want, eqx.is_array), ops=32
    )
    assert avals(new_state) == avals(state)
    assert not new_state.hyperparams["b2"].weak_type


@pytest.mark.parametrize(
    "factory, extra",
    [
        (optax.scale_by_sm3, {}),
        (optax.contrib.reduce_on_plateau, {"value": jnp.float32(1.0)}),
    ],
)
def test_numbers_the_factory_branches_on_are_passed_through(factory, extra):
    """sm3 tests `b2 != 1.0` in Python, reduce_on_plateau checks `factor`:
    injected they would be tracers; they are detected at init and kept static."""
    p = {"w": jnp.ones((3, 2))}
    opt = optax_ext.inject_hyperparams(factory)()
    state = jax.jit(opt.init)(p)
    updates, state = jax.jit(opt.update)(p, state, p, **extra)
    bare = factory()
    want, _ = bare.update(p, bare.init(p), p, **extra)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert state.hyperparams  # the others are still injected
    upstream = optax.inject_hyperparams(factory)()
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(upstream.update)(p, jax.jit(upstream.init)(p), p, **extra)


def test_numpy_int_sizes_are_static():
    P = {"w": jnp.ones((4, 300))}
    opt = optax_ext.inject_hyperparams(optax.adafactor)(
        learning_rate=0.1, min_dim_size_to_factor=np.int64(2)
    )
    state = jax.jit(opt.init)(P)
    assert "min_dim_size_to_factor" not in state.hyperparams


def test_callable_pytree_schedule_is_a_schedule():
    """Outside mask parameters a callable pytree (an Equinox module with
    __call__) is a schedule, as in optax."""

    class Decay(eqx.Module):
        peak: float

        def __call__(self, step):
            return self.peak / (1 + step)

    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=Decay(1.0))
    np.testing.assert_allclose(_three_sgd_updates(opt), [-1.0, -0.5, -1 / 3], rtol=1e-6)
    assert "learning_rate" in opt.init(jnp.zeros(1)).hyperparams


def test_static_args_keep_python_numbers():
    """A name in static_args reaches the factory as the Python number given
    (without it, the same argument is injected: a traced array)."""
    seen = []

    def factory(learning_rate, b1=0.9):
        seen.append(b1)
        return optax.adam(learning_rate, b1=b1)

    for static_args, want_float in [("b1", True), ((), False)]:
        seen.clear()
        opt = optax_ext.inject_hyperparams(factory, static_args=static_args)(
            0.1, b1=0.5
        )
        state = jax.jit(opt.init)(jnp.zeros(2))
        jax.jit(opt.update)(jnp.ones(2), state, jnp.zeros(2))
        assert ("b1" in state.hyperparams) == (not want_float)
        assert seen and all(isinstance(b, float) == want_float for b in seen), seen
        if want_float:
            assert all(b == 0.5 for b in seen)


def test_kwargs_entries_are_passed_through():
    """`**kwargs` entries of the factory are never injected (rule 1), with or
    without static_args; the factory sees the Python number."""
    seen = []

    def factory(learning_rate, **kwargs):
        seen.append(kwargs["b1"])
        return optax.adam(learning_rate, **kwargs)

    for static_args in ["b1", ()]:
        seen.clear()
        opt = optax_ext.inject_hyperparams(factory, static_args=static_args)(
            0.1, b1=0.5
        )
        state = jax.jit(opt.init)(jnp.zeros(2))
        jax.jit(opt.update)(jnp.ones(2), state, jnp.zeros(2))
        assert set(state.hyperparams) == {"learning_rate"}
        assert seen and all(type(b) is float and b == 0.5 for b in seen), seen


@pytest.mark.parametrize("offset", [2, 1, 0])
def test_count_saturates_at_the_int32_maximum(offset):
    """The step count goes up by one and stops at the int32 maximum instead
    of wrapping around (as `optax.safe_increment` does)."""
    top = int(jnp.iinfo(jnp.int32).max)
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = opt.init(jnp.zeros(3))
    state = state._replace(count=jnp.asarray(top - offset, jnp.int32))
    _, state = jax.jit(opt.update)(jnp.ones(3), state)
    assert state.count.dtype == jnp.int32
    assert int(state.count) == min(top - offset + 1, top)


@pytest.mark.filterwarnings("ignore:.*seed.* is deprecated:DeprecationWarning")
def test_per_example_gradients_of_dpsgd_with_the_params():
    """`optax.contrib.dpsgd` takes per-example gradients (a batch axis the
    params lack) together with the params. Injected, it gives dpsgd's own
    updates: a leaf-shape check refused them for one commit. Reference:
    dpsgd unwrapped, jitted alike (no noise, so both are deterministic)."""
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    grads = {
        "w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 2, 3),
        "b": jnp.linspace(0.5, 2.0, 8).reshape(4, 2),
    }
    kwargs = dict(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
    ours = optax_ext.inject_hyperparams(optax.contrib.dpsgd)(**kwargs)
    theirs = optax.contrib.dpsgd(**kwargs)
    got, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    want, _ = jax.jit(theirs.update)(grads, theirs.init(params), params)
    for name in params:
        assert got[name].shape == params[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)


def test_tree_map_params_maps_a_masked_injected_state_as_optax_does():
    """`optax.tree_utils.tree_map_params` (optax's way to give a state the
    params' shardings) calls `init` on a placeholder with no leaves, which
    `optax.masked` lets through; with a mask tree the mask check refused
    it. Reference: the same map over optax's own `inject_hyperparams`."""
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    mapped = []
    for lib in (optax_ext, optax):
        inject = lib.inject_hyperparams(optax.adamw, static_args="mask")
        opt = lib.MultiSteps(
            optax.chain(
                lib.zero_nans(),
                inject(
                    learning_rate=1e-3, weight_decay=0.1, mask={"w": True, "b": False}
                ),
            ),
            2,
        )
        state = opt.init(params)
        mapped.append(
            jax.tree.leaves(
                optax.tree_utils.tree_map_params(
                    opt,
                    lambda p: f"param {p.shape}",
                    state,
                    transform_non_params=lambda x: "other",
                )
            )
        )
    assert mapped[0] == mapped[1]
    assert mapped[0].count("param (2, 3)") == 3  # mu, nu and acc_grads


def test_schedule_with_a_python_branch_keeps_numbers_injected_in_eager_loops():
    """A schedule written with a Python branch runs in an eager loop (under
    `jit` it fails in optax too). Its abstract trial failed with every
    number known, so every number was kept static: the state lacked `b1`
    to `weight_decay` and writing `weight_decay` was refused as a number
    "the factory branches on". Reference: optax's `inject_hyperparams`,
    eagerly, on the same steps."""
    params = {"w": jnp.ones(2)}

    def lr(count):
        return 0.1 if count < 2 else 0.01

    runs = []
    for lib in (optax_ext, optax):
        opt = lib.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=1e-2)
        state, got = opt.init(params), []
        for t in range(4):
            if t == 3:
                state.hyperparams["weight_decay"] = jnp.float32(0.5)
            updates, state = opt.update({"w": jnp.ones(2)}, state, params)
            got.append(np.asarray(updates["w"]))
        runs.append((sorted(state.hyperparams), got))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-6)
