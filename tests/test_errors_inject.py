"""inject_hyperparams refuses bad input at the earliest point (construction,
init, or the first update while tracing), with an error that names the
argument, what was passed and what is expected. Each case silently computed
something else, or failed deep inside optax, before (issue 13)."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import optax_ext

P = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
G = jax.tree.map(jnp.ones_like, P)


def test_factory_that_does_not_return_a_transformation():
    def not_a_factory(learning_rate):
        return learning_rate * 2

    opt = optax_ext.inject_hyperparams(not_a_factory)(learning_rate=0.1)
    with pytest.raises(
        TypeError, match=r"not_a_factory returned .*GradientTransformation"
    ):
        opt.init(P)  # init: the first point where the factory is called
    with pytest.raises(TypeError, match=r"inner_factory must be a function.*got 3"):
        optax_ext.inject_hyperparams(3)


@pytest.mark.parametrize(
    "schedule, match",
    [
        (
            lambda count: jnp.array([0.1, 0.2]),
            r"learning_rate returned an array of shape \(2,\)",
        ),
        (lambda count: None, r"learning_rate returned None"),
        (lambda count: "0.1", r"learning_rate returned '0.1'"),
        (lambda count: jnp.asarray(True), r"learning_rate returned .*bool.*a number"),
    ],
    ids=["shape-2", "None", "str", "bool"],
)
def test_schedule_that_does_not_return_a_scalar_number(schedule, match):
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.init(P)
    with pytest.raises((TypeError, ValueError), match=match):
        jax.jit(opt.init)(P)


def test_schedule_checked_at_update_too():
    """A stateful schedule whose value goes bad after init: caught while
    tracing the update."""

    class Bad(optax.schedules.StatefulSchedule):
        def init(self):
            return jnp.zeros((), jnp.int32)

        def update(self, state, **extra):
            return state + 1

        def __call__(self, state, **extra):
            return jnp.full((2,), 0.1) if extra.get("bad") else jnp.asarray(0.1)

    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=Bad())
    state = opt.init(P)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        opt.update(G, state, P, bad=True)


def test_mask_that_does_not_match_the_params():
    mask = {"w": True}  # params are {"w", "b"}
    opt = optax_ext.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=mask)
    with pytest.raises(
        ValueError, match=r"mask does not match the params.*\{'w': \*\}"
    ):
        opt.init(P)
    fn = lambda params: [True, False]  # noqa: E731 - a function returning a bad tree
    opt = optax_ext.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=fn)
    with pytest.raises(ValueError, match=r"mask does not match"):
        jax.jit(opt.init)(P)
    # A prefix of the params tree is a valid mask, as in optax.masked.
    ok = optax_ext.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=True)
    ok.update(G, ok.init(P), P)


@pytest.mark.parametrize("name", ["learning_rate", "b1"])
def test_number_given_as_a_string(name):
    kwargs = {"learning_rate": 0.1, name: "0.1"}
    with pytest.raises(TypeError, match=rf"{name}='0.1' is a string.*Pass a number"):
        optax_ext.inject_hyperparams(optax.adam)(**kwargs)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, "not a dtype"])
def test_hyperparam_dtype_that_cannot_hold_the_values(dtype):
    """optax casts learning_rate=0.1 to int32, i.e. 0: zero updates, silently."""
    upstream = optax.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.int32)(0.1)
    u, _ = upstream.update(G, upstream.init(P), P)
    assert all(bool((x == 0).all()) for x in jax.tree.leaves(u))
    with pytest.raises(
        (TypeError, ValueError), match=r"hyperparam_dtype must be a floating"
    ):
        optax_ext.inject_hyperparams(optax.sgd, hyperparam_dtype=dtype)


@pytest.mark.parametrize(
    "dtype, name, value, becomes",
    [
        (jnp.bfloat16, "b2", 0.999, "1"),  # optax: Adam's update NaN
        (jnp.float16, "eps", 1e-8, "0"),  # optax: eps 0, a 0 / 0 for a 0 gradient
        (jnp.float16, "eps_root", 1e5, "infinity"),
    ],
)
def test_hyperparam_dtype_that_rounds_a_value_to_0_1_or_inf(
    dtype, name, value, becomes
):
    """hyperparam_dtype=jnp.bfloat16 stores b2=0.999 as 1.0, as optax does:
    Adam's second moment then divides by 1 - b2 = 0. A known value that the
    dtype turns into 0, 1 or infinity is refused, at init and when written
    into the state; named in static_args it is handed over as given."""
    bf16 = {"w": jnp.ones(3, jnp.bfloat16)}
    held = {"learning_rate": 1e-2, "b2": 0.9, "eps": 1e-3, "eps_root": 0.0}
    build = optax_ext.inject_hyperparams(optax.adam, hyperparam_dtype=dtype)
    match = (
        rf"\['{name}'\] holds {value!r}, which {jnp.dtype(dtype)} rounds to {becomes}"
    )
    with pytest.raises(ValueError, match=match):
        build(**{**held, name: value}).init(bf16)
    kept = optax_ext.inject_hyperparams(
        optax.adam, hyperparam_dtype=dtype, static_args=name
    )(**{**held, name: value})
    state = kept.init(bf16)
    u, _ = kept.update(jax.tree.map(lambda p: p * 0.1, bf16), state, bf16)
    assert jnp.isfinite(u["w"].astype(jnp.float32)).all()
    # Written into a state that stores it in the narrow dtype.
    opt = build(**held)
    state = opt.init(bf16)
    state.hyperparams[name] = jnp.float32(value)
    with pytest.raises(ValueError, match=match.replace(f"{value!r}", r"Array\(.*\)")):
        opt.update(bf16, state, bf16)


def test_roundings_that_keep_the_value_s_role_are_accepted():
    """Only 0, 1 (from a decay rate in (0, 1)) and infinity are refused: a
    learning rate of 1.001 rounds to 1.0 in bfloat16 as asked. A schedule's
    values are not checked (under jit they cannot be), eagerly neither."""
    bf16 = {"w": jnp.ones(3, jnp.bfloat16)}
    sgd = optax_ext.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.bfloat16)
    state = sgd(learning_rate=1.001).init(bf16)
    assert state.hyperparams["learning_rate"] == 1
    scheduled = optax_ext.inject_hyperparams(
        optax.adam, hyperparam_dtype=jnp.bfloat16, static_args="b2"
    )(learning_rate=1e-2, b1=lambda count: 0.9995)
    eager = scheduled.update(bf16, scheduled.init(bf16), bf16)[1]
    jitted = jax.jit(scheduled.update)(bf16, jax.jit(scheduled.init)(bf16), bf16)[1]
    assert eager.hyperparams["b1"] == jitted.hyperparams["b1"] == 1


def test_float32_storage_that_rounds_a_decay_to_1_points_to_x64():
    """Without hyperparam_dtype a Python float is stored in float32, which
    rounds b2=0.99999999 to 1: refused, pointing to float64 or static_args."""
    with pytest.raises(
        ValueError, match=r"float32 rounds to 1.*jax_enable_x64.*name b2 in static_args"
    ):
        optax_ext.inject_hyperparams(optax.adam)(1e-3, b2=0.99999999).init(P)


def test_rounding_advice_fits_the_storage():
    """With hyperparam_dtype given, the advice is a wider one, not x64."""
    opt = optax_ext.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"rounds to 1.*a wider hyperparam_dtype"):
        opt(1e-3, b2=1 - 1e-9).init(P)


def test_writing_a_name_that_is_not_injected():
    """optax ignores state.hyperparams['weight_decay'] for adam: refused."""
    opt = optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1)
    state = opt.init(P)
    state.hyperparams["weight_decay"] = 0.1  # adam has no such argument
    with pytest.raises(KeyError, match=r"\['weight_decay'\].*injected ones are"):
        jax.jit(opt.update)(G, state, P)
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1, nesterov=False)
    state = opt.init(P)
    state.hyperparams["nesterov"] = True  # static: passed to the factory as is
    with pytest.raises(
        KeyError, match=r"\['nesterov'\] are passed to the factory unchanged"
    ):
        opt.update(G, state, P)


def test_writing_a_float_into_an_integer_hyperparameter():
    def scaled(factor: int) -> optax.GradientTransformation:
        return optax.scale(factor)

    opt = optax_ext.inject_hyperparams(scaled)(factor=2)
    state = opt.init(P)
    state.hyperparams["factor"] = 0.5
    with pytest.raises(TypeError, match=r"factor'\] holds .*float32.*int32"):
        jax.jit(opt.update)(G, state, P)


@pytest.mark.parametrize(
    "written, error, match",
    [
        (
            jnp.full((2, 2), 1e-3, jnp.float32),
            ValueError,
            r"shape \(2, 2\).*shape \(\)",
        ),
        (jnp.full((1,), 1e-3, jnp.float32), ValueError, r"shape \(1,\).*shape \(\)"),
        ("0.1", TypeError, r"'0.1' \(a str\).*Write a number"),
        (jnp.asarray(True), TypeError, r"a bool would be taken as 0 or 1"),
        (None, TypeError, r"None \(a NoneType\).*Write a number"),
    ],
    ids=["matrix", "vector", "string", "bool", "None"],
)
def test_writing_a_value_of_another_shape_or_kind(written, error, match):
    """Written into the state, a learning rate of shape (2, 2) broadcast the
    updates and changed the params' shapes, one of shape (1,) retraced the
    step, a string or None failed deep inside JAX and a bool was taken as
    1.0 (as in optax): each is refused, naming the entry."""
    opt = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = opt.init(P)
    state.hyperparams["learning_rate"] = written
    with pytest.raises(error, match=r"hyperparams\['learning_rate'\] holds .*" + match):
        opt.update(G, state, P)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"learnin_rate": 1e-3},
            r"adamw: missing a required argument: 'learning_rate'.*"
            r"'learnin_rate' \(did you mean 'learning_rate'\?\)",
        ),
        (
            {"learning_rate": 1e-3, "weight_decy": 0.1},
            r"'weight_decy' \(did you mean 'weight_decay'\?\)",
        ),
    ],
    ids=["missing", "unexpected"],
)
def test_misspelt_argument_is_named(kwargs, match):
    """`learnin_rate=1e-3` was reported as a missing `learning_rate` (as
    optax reports it), naming neither the misspelt name nor the fix."""
    with pytest.raises(TypeError, match=match):
        optax_ext.inject_hyperparams(optax.adamw)(**kwargs)


def test_wrong_state():
    opt = optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1)
    with pytest.raises(
        TypeError,
        match=r"state must be the optax.InjectStatefulHyperparamsState.*"
        r"ScaleByAdamState",
    ):
        opt.update(G, optax.scale_by_adam().init(P), P)


BAD_ARGUMENTS = {
    "learning_rate": st.sampled_from(["0.1", "1e-3", ""]),
    "b1": st.sampled_from(["0.9", "x"]),
}


@settings(max_examples=15)
@given(
    name=st.sampled_from(sorted(BAD_ARGUMENTS)),
    data=st.data(),
    dtype=st.sampled_from([jnp.int8, jnp.int32, jnp.uint32, jnp.bool_, np.int64]),
)
def test_bad_constructor_arguments_property(name, data, dtype):
    """Any string for a number, any non-floating hyperparam_dtype: refused
    when the optimizer is built, naming the argument and the value."""
    value = data.draw(BAD_ARGUMENTS[name])
    with pytest.raises(TypeError, match=rf"{name}={value!r} is a string"):
        optax_ext.inject_hyperparams(optax.adam)(**{"learning_rate": 0.1, name: value})
    with pytest.raises(ValueError, match=rf"got {jnp.dtype(dtype)}"):
        optax_ext.inject_hyperparams(optax.adam, hyperparam_dtype=dtype)


def test_strings_the_factory_takes_are_passed_through():
    """A string where the annotation names str or a Literal of strings (muon's
    preconditioning) is an option, not a misspelt number."""
    opt = optax_ext.inject_hyperparams(optax.contrib.muon)(
        learning_rate=1e-2, preconditioning="spectral"
    )
    opt.init({"w": jnp.ones((3, 3))})


def test_state_of_another_injected_optimizer():
    """The state of `inject_hyperparams(sgd)` given to `inject_hyperparams(adam)`
    was reported as names written into `state.hyperparams`."""
    opt = optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1)
    other = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    with pytest.raises(
        TypeError,
        match=r"inject_hyperparams\(adam\)\.update's `state` was not built by "
        r"this optimizer: its hyperparams are \['learning_rate', 'momentum'\]",
    ):
        opt.update(G, other.init(P), P)


def test_updates_that_do_not_fit_the_params():
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    opt = optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1)
    with pytest.raises(
        ValueError,
        match=r"inject_hyperparams\(adam\)\.update: The tree of the updates does "
        r"not match the params: the updates have nothing at \['b'\]",
    ):
        opt.update({"w": jnp.ones(3)}, opt.init(params), params)


def test_integer_given_where_the_default_is_a_float_is_a_float():
    """`weight_decay=0` (adamw's default is 1e-4) is stored as float32, so a
    float written there later is taken, as optax takes it. Reference: adamw
    built with the written value, each number rounded to float32 as the
    stored hyperparameters are."""
    opt = optax_ext.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0)
    state = opt.init(P)
    assert state.hyperparams["weight_decay"].dtype == jnp.float32
    state.hyperparams["weight_decay"] = jnp.float32(0.5)
    u, _ = jax.jit(opt.update)(G, state, P)

    def f32(x):
        return float(np.float32(x))

    bare = optax.adamw(
        f32(0.1), b1=f32(0.9), b2=f32(0.999), eps=f32(1e-8), weight_decay=0.5
    )
    want, _ = jax.jit(bare.update)(G, bare.init(P), P)
    jax.tree.map(np.testing.assert_array_equal, u, want)
    # learning_rate has no default, but its annotation names float and not
    # int: an int given there is a float too (see test_equality.py's
    # hypergradient through `learning_rate=1`).
    state = optax_ext.inject_hyperparams(optax.adamw)(learning_rate=1).init(P)
    assert state.hyperparams["learning_rate"].dtype == jnp.float32
