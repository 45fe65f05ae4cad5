"""MultiSteps: window sizes, bad arguments and bad states (issue 13).

Each error names the argument, what was passed and what is expected, and is
raised at the earliest point: the constructor, `init`, or the first `update`
while tracing. Traced window sizes that cannot be checked are given a defined
behaviour that never emits a wrong update.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_exact_zeros, to_np

import optax_ext

# --- every_k_schedule --------------------------------------------------------


@pytest.mark.parametrize("k", [2**31, 2**40, 2**31 + 5])
def test_every_k_constant_out_of_int32_range_is_refused_at_construction(k):
    """Issue 13: `every_k_schedule=2**31` passed the constructor and
    overflowed int32 at the first update."""
    with pytest.raises(
        ValueError,
        match=rf"every_k_schedule must be an int from 1 to 2\*\*31 - 1, got {k}",
    ):
        optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=k)


def test_every_k_constant_at_int32_max_is_accepted():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=2**31 - 1)
    u, _ = opt.update(jnp.ones(1), opt.init(jnp.zeros(1)))
    assert_exact_zeros(u)


@pytest.mark.parametrize("k", [2.5, 0.5, 1.0000001, float("nan"), float("inf")])
def test_non_integer_schedule_output_is_an_error_eagerly(k):
    """Issue 13: a schedule returning 2.5 was silently rounded up to 3."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=lambda step: k)
    state = opt.init(jnp.zeros(2))
    with pytest.raises(
        ValueError, match=r"every_k_schedule returned .* gradient step 0"
    ):
        opt.update(jnp.ones(2), state)
    # As a concrete array too.
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=lambda step: jnp.float32(k)
    )
    with pytest.raises(ValueError, match="every_k_schedule returned"):
        opt.update(jnp.ones(2), state)


@pytest.mark.parametrize(
    "k", [0.0, 2.5, float("nan"), 0, -2, 2**31, np.float32(2.5), np.int64(0)]
)
def test_constant_schedule_output_is_checked_under_jit(k):
    """A schedule returning a constant is checked in the jitted step too: under
    `jit` a Python 2.5 was taken for a traced value and rounded up to 3, and
    0.0 or NaN never emitted, silently. The error comes while tracing."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=lambda step: k)
    state = opt.init(jnp.zeros(2))
    with pytest.raises(ValueError, match=r"every_k_schedule returned"):
        jax.jit(opt.update)(jnp.ones(2), state)


def test_integral_float_schedule_output_is_accepted():
    """optax accepts a float k holding a whole number; so do we."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=lambda step: 2.0)
    state = opt.init(jnp.zeros(1))
    _, state = opt.update(jnp.array([1.0]), state)
    u, state = opt.update(jnp.array([3.0]), state)
    np.testing.assert_array_equal(to_np(u), [-2.0])


def test_schedule_output_out_of_int32_range_is_an_error():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=lambda step: 2**31)
    with pytest.raises(ValueError, match=r"every_k_schedule returned 2147483648"):
        opt.update(jnp.ones(1), opt.init(jnp.zeros(1)))


def _traced_k_run(k_value, n_steps=6):
    """Runs sgd(1) through MultiSteps with a traced k under jit."""
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), every_k_schedule=lambda step: jnp.asarray(k_value) + 0 * step
    )
    state = opt.init(jnp.zeros(2))
    step = jax.jit(opt.update)
    outs, updated = [], []
    grads = [jnp.array([float(i + 1), -2.0 * (i + 1)]) for i in range(n_steps)]
    for g in grads:
        u, state = step(g, state)
        outs.append(to_np(u))
        updated.append(bool(opt.has_updated(state)))
    return opt, state, grads, outs, updated


def test_traced_fractional_k_closes_the_window_at_ceil_k():
    """Documented: a traced k that is not a whole number closes the window at
    the first mini-step count reaching it (ceil(k)); no gradient is lost:
    the emitted update is the mean of all ceil(k) gradients."""
    _, state, grads, outs, updated = _traced_k_run(jnp.float32(2.5))
    assert updated == [False, False, True, False, False, True]
    np.testing.assert_allclose(outs[2], -np.mean(grads[:3], axis=0), rtol=1e-7)
    np.testing.assert_allclose(outs[5], -np.mean(grads[3:6], axis=0), rtol=1e-7)


@pytest.mark.parametrize(
    "k", [jnp.int32(0), jnp.int32(-3), jnp.float32(-0.5), jnp.float32(jnp.nan)]
)
def test_traced_k_not_positive_never_emits_and_keeps_accumulating(k):
    """Issue 13: a traced k <= 0 emitted on every step as if k were 1. Now
    (as in optax, which never emits for such k) the window never closes:
    zero updates, and the accumulator keeps the running mean of every
    gradient, so none is lost."""
    _, state, grads, outs, updated = _traced_k_run(k)
    assert not any(updated)
    for u in outs:
        assert_exact_zeros(jnp.asarray(u))
    assert int(state.mini_step) == len(grads) and int(state.gradient_step) == 0
    np.testing.assert_allclose(
        to_np(state.acc_grads), np.mean(grads, axis=0), rtol=1e-7
    )


def test_mini_step_saturates_instead_of_wrapping():
    """With a window that never closes, mini_step stops at the int32 maximum
    rather than wrapping to a negative count."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), every_k_schedule=lambda s: 0 * s)
    state = opt.init(jnp.zeros(1))
    top = jnp.iinfo(jnp.int32).max
    state = state._replace(mini_step=jnp.asarray(top, jnp.int32))
    u, state = jax.jit(opt.update)(jnp.ones(1), state)
    assert int(state.mini_step) == top
    assert_exact_zeros(u)


# --- accumulator_dtype ---------------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, "not a dtype", 3])
def test_accumulator_dtype_must_be_inexact(bad):
    with pytest.raises(TypeError, match=r"accumulator_dtype must be a floating"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=bad)


@pytest.mark.parametrize(
    "wide", [np.float64, jnp.complex128, np.dtype("float64"), "float64"]
)
def test_64_bit_accumulator_without_x64_is_refused(wide):
    """Without x64 JAX canonicalises float64 to float32: the accumulator
    came out float32, with no sign but JAX's warning at init."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: float64 is what it says")
    with pytest.raises(ValueError, match=r"needs 64-bit JAX.*jax_enable_x64"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=wide)
    with pytest.raises(ValueError, match=r"needs 64-bit JAX"):
        optax_ext.microbatched(lambda p, x: p * x, 2, accumulator_dtype=np.float64)
    # Python's float names JAX's default float, as in jnp.zeros(3, float).
    state = optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=float).init(
        jnp.zeros(2, jnp.bfloat16)
    )
    assert state.acc_grads.dtype == jnp.float32


def test_params_and_accumulator_dtype_without_a_common_dtype_name_both():
    """float8_e4m3fn and float8_e5m2 do not hold each other's values."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=jnp.float8_e5m2)
    with pytest.raises(
        TypeError,
        match=r"accumulator_dtype=float8_e5m2.*\['w'\].*float8_e4m3fn",
    ):
        opt.init({"w": jnp.zeros(2, jnp.float8_e4m3fn)})


# --- the state ---------------------------------------------------------------


def _bad_states():
    params = jnp.zeros(2)
    return {
        "None": None,
        "adam state": optax.adam(1e-3).init(params),
        "inner state": optax_ext.MultiSteps(optax.sgd(1.0), 2)
        .init(params)
        .inner_opt_state,
        "dict": {"mini_step": 0},
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("which", list(_bad_states()))
def test_wrong_state_names_the_argument(which, jit):
    """Issue 13: an adam state, None or another optimizer's state gave
    `AttributeError ... no attribute 'acc_grads'` from deep inside."""
    opt = optax_ext.MultiSteps(optax.adam(1e-3), 2)
    update = jax.jit(opt.update) if jit else opt.update
    with pytest.raises(
        TypeError,
        match=r"MultiSteps.update's `state` must be the optax.MultiStepsState",
    ):
        update(jnp.ones(2), _bad_states()[which], jnp.zeros(2))


@pytest.mark.parametrize("method", ["emits_next", "has_updated", "optax_state"])
@pytest.mark.parametrize("which", ["adam state", "None"])
def test_wrong_state_in_the_state_readers_names_it(method, which):
    """`emits_next` (the check the docs give for a resumed loop),
    `has_updated` and `optax_state` gave `AttributeError: 'tuple' object has
    no attribute 'mini_step'`."""
    opt = optax_ext.MultiSteps(optax.adam(1e-3), 2)
    with pytest.raises(
        TypeError, match=rf"MultiSteps.{method}'s `state` must be the optax."
    ):
        getattr(opt, method)(_bad_states()[which])


def test_has_updated_reads_stacked_states_and_python_counters_as_optax():
    """The state readers check the state's fields, not its counters' shape:
    `has_updated` of a stack of states (one per vmapped run) or of Python
    int counters answers as optax's does."""
    ours = optax_ext.MultiSteps(optax.adam(1e-3), 2)
    theirs = optax.MultiSteps(optax.adam(1e-3), 2)
    stacked = jax.vmap(ours.init)({"w": jnp.ones((4, 3))})
    stacked = stacked._replace(
        mini_step=jnp.array([0, 1, 0, 1]), gradient_step=jnp.array([0, 0, 2, 2])
    )
    np.testing.assert_array_equal(
        ours.has_updated(stacked), theirs.has_updated(stacked)
    )
    assert list(ours.has_updated(stacked)) == [False, False, True, False]
    plain = ours.init({"w": jnp.ones(3)})._replace(mini_step=0, gradient_step=3)
    assert bool(ours.has_updated(plain)) and bool(theirs.has_updated(plain))
    assert ours.emits_next(plain._replace(mini_step=1))  # Python ints read too


@pytest.mark.parametrize("method", ["emits_next", "optax_state"])
def test_state_readers_of_one_window_refuse_a_stack_of_states(method):
    """`optax_state` of a stack (counters of shape (n,)) lined `mini_step`
    up with the accumulator's last axis: wrong numbers; `emits_next` cut a
    float counter to an int. One state's counters are scalar integers."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    stacked = jax.vmap(opt.init)(jnp.zeros((3, 3)))
    with pytest.raises(
        TypeError, match=rf"{method}'s `state.mini_step` must be a scalar"
    ):
        getattr(opt, method)(stacked)
    state = opt.init(jnp.zeros(3))._replace(mini_step=1.7)
    with pytest.raises(TypeError, match=r"must be a scalar integer"):
        getattr(opt, method)(state)
    # vmapped, each state is one window's
    starts = jax.vmap(opt.optax_state)(stacked._replace(mini_step=jnp.array([1, 0, 1])))
    assert starts.acc_grads.shape == (3, 3)


@pytest.mark.parametrize("value", [None, "no", 0.5, 1])
def test_use_grad_mean_must_be_a_bool(value):
    """Optax takes any value and branches on its truth: None silently sums."""
    with pytest.raises(TypeError, match=r"use_grad_mean must be True .* or False"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, use_grad_mean=value)
    optax_ext.MultiSteps(optax.sgd(1.0), 2, use_grad_mean=np.bool_(False))


def test_a_container_where_an_array_is_expected_is_described():
    """A list of gradients where the params hold an array was reported as
    'nothing' there."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(2)}
    with pytest.raises(
        ValueError,
        match=r"the updates have a tree with leaves at \['w'\]\[0\], \['w'\]\[1\] "
        r"at \['w'\], where the accumulated gradients in the state hold an array",
    ):
        opt.update({"w": [1.0, 1.0]}, opt.init(params), params)


def test_another_optimizers_multi_steps_state_is_refused():
    params = jnp.zeros(2)
    sgd_state = optax_ext.MultiSteps(optax.sgd(1.0), 2).init(params)
    opt = optax_ext.MultiSteps(optax.adam(1e-3), 2)
    for update in (opt.update, jax.jit(opt.update)):
        with pytest.raises(TypeError, match=r"state.inner_opt_state.*structure"):
            update(jnp.ones(2), sgd_state, params)


def test_state_with_non_integer_counters_is_refused():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    state = opt.init(jnp.zeros(2))._replace(mini_step=0.5)
    with pytest.raises(TypeError, match=r"state.mini_step.*scalar integer"):
        opt.update(jnp.ones(2), state)


def test_wrong_state_in_apply_gradients_names_it():
    """The fused step's errors name the function called and its argument
    (they named `MultiSteps.update`'s or `MultiSteps.apply_gradients`'s
    `state`, neither of which the caller wrote)."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(TypeError, match=r"optax_ext\.apply_gradients's `opt_state`"):
        optax_ext.apply_gradients(opt, jnp.ones(2), None, jnp.zeros(2))
    adam = optax_ext.MultiSteps(optax.adam(1.0), 2)
    state = adam.init(jnp.zeros(2))._replace(inner_opt_state=opt.init(jnp.zeros(2)))
    with pytest.raises(
        TypeError, match=r"optax_ext\.apply_gradients's `opt_state\.inner_opt_state`"
    ):
        optax_ext.apply_gradients(adam, jnp.ones(2), state, jnp.zeros(2))
    per_device = optax_ext.MultiSteps(optax.sgd(1.0), 2, axis_name="d")
    with pytest.raises(
        NameError,
        match=r"optax_ext\.apply_gradients with MultiSteps\(axis_name='d'\) must run",
    ):
        optax_ext.apply_gradients(
            per_device, jnp.ones(2), opt.init(jnp.zeros(2)), jnp.zeros(2)
        )


def test_optax_state_still_loads():
    """The state check accepts optax.MultiSteps' own state (checkpoints move
    both ways)."""
    params = {"w": jnp.zeros(3)}
    state = optax.MultiSteps(optax.adam(1e-2), 2).init(params)
    opt = optax_ext.MultiSteps(optax.adam(1e-2), 2)
    _, state = opt.update({"w": jnp.ones(3)}, state, params)
    u, _ = opt.update({"w": jnp.ones(3)}, state, params)
    assert float(jnp.abs(u["w"]).max()) > 0


# --- has_updated ---------------------------------------------------------------


@pytest.mark.parametrize(
    "impl", [optax_ext.MultiSteps, optax.MultiSteps], ids=["optax_ext", "optax"]
)
def test_has_updated_after_a_skipped_step_is_as_documented(impl):
    """`has_updated` is True when the last *accepted* mini-step completed a
    window: a skipped step right after an emitting one leaves it True
    although that step returned zeros. optax does the same, and the state
    (shared with optax) has no room to record the skip."""
    opt = impl(optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite)
    state = opt.init(jnp.zeros(1))
    _, state = opt.update(jnp.ones(1), state)
    assert not bool(opt.has_updated(state))
    u, state = opt.update(jnp.ones(1), state)
    assert bool(opt.has_updated(state)) and float(u[0]) == -1.0
    u, state = opt.update(jnp.array([jnp.nan]), state)  # skipped
    assert bool(opt.has_updated(state))
    assert_exact_zeros(u)
    _, state = opt.update(jnp.ones(1), state)
    assert not bool(opt.has_updated(state))


def test_has_updated_docstring_states_the_skip_case():
    doc = optax_ext.MultiSteps.has_updated.__doc__
    assert "skipped" in doc and "accepted" in doc


# --- Equinox models keep working ---------------------------------------------


def test_equinox_filter_grad_of_a_dict_with_integer_leaves():
    """A plain dict with an integer array: it gets state (as in optax), and
    `eqx.filter_grad`'s None gradient for it gives a None update."""
    params = {"w": jnp.array([1.0, 2.0]), "idx": jnp.array([1, 0])}

    def loss(p):
        return jnp.sum(p["w"][p["idx"]] ** 2)

    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    state = opt.init(params)
    step = eqx.filter_jit(opt.update)
    for _ in range(2):
        grads = eqx.filter_grad(loss)(params)
        assert grads["idx"] is None
        updates, state = step(grads, state, params)
    assert updates["idx"] is None
    np.testing.assert_array_equal(to_np(updates["w"]), [-2.0, -4.0])
    new = optax_ext.apply_gradients(opt, grads, state, params)[0]
    np.testing.assert_array_equal(np.asarray(new["idx"]), [1, 0])


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_float0_gradient_is_named(form):
    """`jax.grad(..., allow_int=True)` gives an integer param a float0
    gradient. Nothing can be accumulated or applied there (Optax's own
    optimizers and `apply_updates` refuse float0 too), so MultiSteps says so,
    naming the leaf and the way out; it raised a bare dtype-promotion error
    naming neither."""
    params = {"w": jnp.ones(3), "n": jnp.arange(2)}
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
    assert grads["n"].dtype == jax.dtypes.float0
    opt = optax_ext.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    state = opt.init(params)
    with pytest.raises(
        TypeError, match=r"gradient at \['n'\] has dtype float0.*allow_int.*None"
    ):
        if form == "update":
            opt.update(grads, state, params)
        else:
            optax_ext.apply_gradients(opt, grads, state, params)


def test_state_restored_without_a_target_gets_its_own_hint(tmp_path):
    """Restored by orbax without a target, the state comes back a dict of
    its fields; the error said to pass the whole MultiSteps state (not its
    inner state), which it was. It now says how to restore it."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.ones(3)}
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", opt.init(params))
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state")
    assert isinstance(restored, dict)
    with pytest.raises(TypeError, match=r"restored without a target.*eval_shape"):
        opt.update(params, restored, params)
    # Restored into the abstract state, it is the state again.
    abstract = jax.eval_shape(opt.init, params)
    state = checkpointer.restore(tmp_path / "state", abstract)
    opt.update(params, state, params)


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_params_that_do_not_fit_the_state_are_named(form):
    """Params of another tree or other shapes than `init` was given: the
    error names the params and the path. It blamed the inner state's
    structure (a missing key), or was JAX's own broadcasting error with no
    argument or path (a wrong shape, fused)."""
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    state = opt.init(params)

    def step(p):
        if form == "update":
            return opt.update(params, state, p)
        return optax_ext.apply_gradients(opt, params, state, p)

    with pytest.raises(ValueError, match=r"the params have nothing at \['w'\]"):
        step({"b": jnp.ones(2)})
    with pytest.raises(
        ValueError, match=r"At \['w'\] the params have shape \(4,\).*shape \(3,\)"
    ):
        step({"w": jnp.ones(4), "b": jnp.ones(2)})
    step(params)  # the params init was given
    # An Equinox model: its non-array leaves hold None in the state.
    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    state = opt.init(model)
    grads = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_array))
    optax_ext.apply_gradients(opt, grads, state, model)
    other = eqx.nn.Linear(2, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"The tree of the params does not match"):
        optax_ext.apply_gradients(opt, grads, state, other)


def test_apply_gradients_without_params_is_named():
    """`apply_gradients(opt, grads, state, None)` raised an internal
    error about a missing positional argument."""
    for opt in (
        optax_ext.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
        optax.sgd(0.1),
    ):
        state = opt.init({"w": jnp.ones(3)})
        with pytest.raises(TypeError, match=r"apply_gradients: params is None"):
            optax_ext.apply_gradients(opt, {"w": jnp.ones(3)}, state, None)


def _changing_state(change):
    """sgd whose `update` returns its state changed by `change`."""
    inner = optax.sgd(1.0)
    return optax.GradientTransformation(
        inner.init,
        lambda g, s, p=None: (inner.update(g, s, p)[0], change(s)),
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda s: (s, optax.EmptyState()),
        lambda s: jnp.zeros(3),
        lambda s: (*s, jnp.zeros(2)),
    ],
)
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_inner_state_that_changes_its_tree_is_named(change, form):
    """A state kept on some mini-steps must keep its tree: the step that
    would carry it names both trees (not a bare `lax.cond` type error)."""
    opt = optax_ext.MultiSteps(_changing_state(change), every_k_schedule=2)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    step = (
        (lambda g, s: opt.update(g, s, params))
        if form == "update"
        else (lambda g, s: optax_ext.apply_gradients(opt, g, s, params))
    )
    with pytest.raises(
        ValueError,
        match="inner optimizer's new state does not match the inner state it was given",
    ):
        jax.jit(step)({"w": jnp.ones(2)}, state)


def test_inner_state_that_changes_its_shapes_is_named():
    inner = optax.scale_by_adam()
    grow = lambda s: s._replace(mu=jax.tree.map(lambda m: jnp.zeros(3), s.mu))
    tx = optax.GradientTransformation(
        inner.init, lambda g, s, p=None: (inner.update(g, s, p)[0], grow(s))
    )
    opt = optax_ext.MultiSteps(tx, every_k_schedule=2)
    state = opt.init({"w": jnp.zeros(2)})
    with pytest.raises(
        ValueError,
        match=r"At .*mu\['w'\] the inner optimizer's new state have shape \(3,\)",
    ):
        opt.update({"w": jnp.ones(2)}, state)
