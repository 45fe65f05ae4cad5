"""Optimizers as values: equality means "builds the same program for the same
inputs", equal objects hash equal, a traced value is never read, and two
equal optimizers behave the same whatever ran before on either.

The references are optax's own `inject_hyperparams` and optimizers built
apart (each jitted on its own), never a shared compile.
"""

import functools
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_ext

P = {"w": jnp.ones(2)}
G = {"w": jnp.ones(2)}


def _same_bits(a, b):
    """Bit for bit (NaN included) with the same dtype and weak type."""
    a_leaves, b_leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a_leaves) == len(b_leaves)
    for x, y in zip(a_leaves, b_leaves, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


# -- traced values are compared by identity, never read ----------------------


def _loss_after_one_step(inject, lr):
    opt = inject(optax.sgd)(learning_rate=lr)
    u, _ = jax.jit(opt.update)(G, jax.jit(opt.init)(P), P)
    return jnp.sum(optax.apply_updates(P, u)["w"] ** 2)


def test_hypergradient_not_shared_with_an_equal_valued_optimizer():
    """An optimizer built from a JVP tracer compared equal to one built from
    its primal (`.item()` reads a JVP tracer's primal), so `jax.jit`'s cache
    handed it the other's compile and the hypergradient was 0."""
    keep = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=jnp.float32(0.1))
    jax.jit(keep.init)(P)  # an ordinary optimizer, still alive
    got = jax.grad(
        functools.partial(_loss_after_one_step, optax_ext.inject_hyperparams)
    )(jnp.float32(0.1))
    expected = jax.grad(
        functools.partial(_loss_after_one_step, optax.inject_hyperparams)
    )(jnp.float32(0.1))
    assert got != 0.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("jit_grad", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_meta_learning_matches_optax(static, jit_grad):
    """Hypergradients through a learning rate given to the factory, with
    the optimizer a static argument of a jitted step or closed over, the
    outer `grad` eager or jitted, then an ordinary step: equal to optax's,
    and no leaked tracer."""

    def make_step(inject):
        if static:

            @functools.partial(jax.jit, static_argnums=0)
            def step(opt, params):
                u, _ = opt.update(G, opt.init(params), params)
                return optax.apply_updates(params, u)

            return lambda opt, params: step(opt, params)

        def closed(opt, params):
            @jax.jit
            def step(params):
                u, _ = opt.update(G, opt.init(params), params)
                return optax.apply_updates(params, u)

            return step(params)

        return closed

    def meta_loss(inject, step, lr):
        opt = inject(optax.sgd)(learning_rate=lr)
        return jnp.sum(step(opt, P)["w"] ** 2)

    results = {}
    for name, inject in (
        ("ext", optax_ext.inject_hyperparams),
        ("optax", optax.inject_hyperparams),
    ):
        step = make_step(inject)
        plain = step(inject(optax.sgd)(learning_rate=jnp.float32(0.1)), P)
        grad = jax.grad(functools.partial(meta_loss, inject, step))
        if jit_grad:
            grad = jax.jit(grad)
        hyper = grad(jnp.float32(0.1))
        after = step(inject(optax.sgd)(learning_rate=jnp.float32(0.1)), P)
        results[name] = (plain, hyper, after)
    ext, ref = results["ext"], results["optax"]
    for x, y in zip(ext, ref, strict=True):
        np.testing.assert_allclose(
            np.asarray(jax.tree.leaves(x)), np.asarray(jax.tree.leaves(y)), rtol=1e-6
        )
    assert results["ext"][1] != 0.0


def test_optimizer_built_from_a_tracer_is_not_equal_to_its_primal():
    seen = {}

    def f(lr):
        traced = optax_ext.inject_hyperparams(optax.sgd)(learning_rate=lr)
        concrete = optax_ext.inject_hyperparams(optax.sgd)(
            learning_rate=jnp.float32(0.1)
        )
        seen["equal"] = traced == concrete
        seen["self"] = traced == traced
        hash(traced)  # never reads the tracer
        return lr

    jax.grad(f)(jnp.float32(0.1))
    assert seen == {"equal": False, "self": True}
    jax.jit(f)(jnp.float32(0.1))
    assert seen == {"equal": False, "self": True}


# -- typed keys, weak types, NaN ------------------------------------------


def test_typed_prng_key_argument():
    """`.item()` on a 0-d key array raised NotImplementedError."""
    build = optax_ext.inject_hyperparams(optax.noisy_sgd)
    opt = build(learning_rate=0.1, key=jax.random.key(0))
    assert opt == build(learning_rate=0.1, key=jax.random.key(0))
    assert hash(opt) == hash(build(learning_rate=0.1, key=jax.random.key(0)))
    assert opt != build(learning_rate=0.1, key=jax.random.key(1))
    ref = optax.inject_hyperparams(optax.noisy_sgd)(
        learning_rate=0.1, key=jax.random.key(0)
    )
    got = jax.jit(opt.update)(G, jax.jit(opt.init)(P), P)[0]
    expected = jax.jit(ref.update)(G, jax.jit(ref.init)(P), P)[0]
    _same_bits(got, expected)


def test_weak_and_strong_scalars_do_not_share_a_compile():
    """A weakly typed 0-d array and a strongly typed one of the same value
    build different programs with bfloat16 params (the weak one keeps the
    updates bfloat16): they compared equal and shared a compile."""
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    build = optax_ext.inject_hyperparams(optax.sgd)
    weak = build(learning_rate=jnp.asarray(0.3))
    strong = build(learning_rate=jnp.float32(0.3))
    assert weak != strong

    @functools.partial(jax.jit, static_argnums=0)
    def step(opt, params):
        return opt.update(params, opt.init(params), params)[0]

    step(weak, params)
    shared = step(strong, params)
    apart = jax.jit(lambda p: strong.update(p, strong.init(p), p)[0])(params)
    _same_bits(shared, apart)


def test_numpy_and_jax_scalars_differ_under_hyperparam_dtype():
    build = optax_ext.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.bfloat16)
    a = build(learning_rate=np.float32(0.3))
    b = build(learning_rate=jnp.float32(0.3))
    assert a != b  # a JAX array keeps its dtype, a NumPy one is cast


@pytest.mark.parametrize(
    "make",
    [
        lambda: float("nan"),
        lambda: np.float32("nan"),
        lambda: jnp.asarray(float("nan")),
        lambda: jnp.float32(float("nan")),
    ],
    ids=["python", "numpy", "jax-weak", "jax-strong"],
)
def test_nan_equal_and_equal_hash(make):
    build = optax_ext.inject_hyperparams(optax.sgd)
    one = make()
    a, b, c = (
        build(learning_rate=one),
        build(learning_rate=one),
        build(learning_rate=make()),
    )
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)


def test_python_number_types_differ():
    build = optax_ext.inject_hyperparams(optax.sgd)
    ones = [build(learning_rate=v) for v in (1, 1.0, True)]
    assert ones[0] != ones[1] and ones[1] != ones[2] and ones[0] != ones[2]
    assert build(learning_rate=0.0) != build(learning_rate=-0.0)
    assert optax_ext.zero_nans() == optax_ext.zero_nans()


def test_writeable_numpy_array_compares_by_identity():
    """A NumPy array can change after the optimizer is built: compared by
    value, an optimizer would keep another's compile after the change."""
    build = optax_ext.inject_hyperparams(optax.sgd)
    lr = np.asarray(0.1, np.float32)
    assert build(learning_rate=lr) == build(learning_rate=lr)
    assert build(learning_rate=lr) != build(learning_rate=np.asarray(0.1, np.float32))
    frozen = np.asarray(0.1, np.float32)
    frozen.flags.writeable = False
    other = np.asarray(0.1, np.float32)
    other.flags.writeable = False
    assert build(learning_rate=frozen) == build(learning_rate=other)


def test_container_holding_a_writeable_array_compares_by_its_contents():
    """A mask dict holding a writeable NumPy array (0-d here) was compared
    by the identity of the copy each optimizer keeps of it, so two
    optimizers built from the same dict differed, and a jitted step taking
    the optimizer as a static argument compiled again for each rebuild.
    Containers are now compared by their contents: each leaf by value, or
    by identity where it is compared so (the same array, not an equal one).
    """
    mask = {"a": np.array(True), "b": np.array(False)}
    build = optax_ext.inject_hyperparams(optax.adamw)
    first, again = (build(learning_rate=0.1, mask=mask) for _ in range(2))
    assert first == again and hash(first) == hash(again)
    rebuilt = {"a": mask["a"], "b": mask["b"]}  # another dict, the same arrays
    assert build(learning_rate=0.1, mask=rebuilt) == first
    fresh = {"a": np.array(True), "b": np.array(False)}  # equal, not the same
    assert build(learning_rate=0.1, mask=fresh) != first

    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def step(opt, params):
        traces.append(None)
        return opt.update(params, opt.init(params), params)[0]

    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    for _ in range(3):
        step(build(learning_rate=0.1, mask=mask), params)
    assert len(traces) == 1


# -- hypothesis: both laws, and equal means the same jitted result -----------

_KINDS = {
    "python-float": float,
    "python-int": lambda v: int(v) if float(v).is_integer() else None,
    "python-bool": lambda v: bool(v) if v in (0.0, 1.0) else None,
    "numpy-f32": np.float32,
    "numpy-f64": np.float64,
    "numpy-0d-readonly": lambda v: _readonly(np.asarray(v, np.float32)),
    "jax-weak": lambda v: jnp.asarray(v),
    "jax-f32": jnp.float32,
    "jax-bf16": jnp.bfloat16,
    "jax-f16": jnp.float16,
}


def _readonly(a):
    a.flags.writeable = False
    return a


_VALUES = [0.0, -0.0, 1.0, 0.1, 0.3, float("nan"), 2.0]


@st.composite
def _configs(draw):
    kind = draw(st.sampled_from(sorted(_KINDS)))
    value = draw(st.sampled_from(_VALUES))
    made = _KINDS[kind](value)
    hypothesis.assume(made is not None)
    factory = draw(st.sampled_from(["sgd", "adam"]))
    dtype = draw(st.sampled_from([None, "float32"]))
    return kind, value, factory, dtype


def _build(config):
    kind, value, factory, dtype = config
    inject = optax_ext.inject_hyperparams(
        getattr(optax, factory), hyperparam_dtype=dtype and jnp.dtype(dtype)
    )
    return inject(learning_rate=_KINDS[kind](value))  # a fresh value each time


@functools.partial(jax.jit, static_argnums=0)
def _shared_step(opt, params):
    state = opt.init(params)
    u, state = opt.update(params, state, params)
    return opt.update(u, state, params)


def _apart(opt, params):
    def step(params):
        state = opt.init(params)
        u, state = opt.update(params, state, params)
        return opt.update(u, state, params)

    return jax.jit(step)(params)


@hypothesis.given(a=_configs(), b=_configs())
@hypothesis.settings(max_examples=30)
def test_equality_laws_and_equal_means_same_program(a, b):
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)}
    opt_a, opt_b, opt_b_again = _build(a), _build(b), _build(b)
    assert opt_b == opt_b_again and hash(opt_b) == hash(opt_b_again)
    if opt_a == opt_b:
        assert hash(opt_a) == hash(opt_b)
    # Whatever the jit cache shares, each gets its own program's result.
    _shared_step(opt_a, params)
    _same_bits(_shared_step(opt_b, params), _apart(opt_b, params))
    if opt_a == opt_b:
        _same_bits(_apart(opt_a, params), _apart(opt_b, params))


# -- no behaviour in per-object caches ---------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_static_hyperparameter_written_raises_on_equal_fresh_object(jit):
    """sm3 branches on `b2` in Python, so it is passed through and a value
    written into `state.hyperparams` is refused. Only the object that ran
    `init` knew: an equal one (rebuilt after a restore) used it silently
    eager and failed deep in JAX under jit."""
    build = optax_ext.inject_hyperparams(optax.scale_by_sm3)
    ran_init = build(b1=0.9, b2=0.9)
    state = ran_init.init(P)
    assert "b2" not in state.hyperparams
    written = state._replace(hyperparams={**state.hyperparams, "b2": jnp.float32(0.5)})
    fresh = build(b1=0.9, b2=0.9)
    assert fresh == ran_init
    messages = []
    for opt in (ran_init, fresh, build(b1=0.9, b2=0.9)):
        update = jax.jit(opt.update) if jit else opt.update
        with pytest.raises(KeyError) as info:
            update(G, written, P)
        messages.append(str(info.value))
    assert messages[0] == messages[1] == messages[2]
    assert "b2" in messages[0]


@pytest.mark.parametrize("wrap", ["multi_steps", "skip_when"])
def test_weak_value_written_is_made_strong_by_an_equal_fresh_object(wrap):
    """A learning rate written into the state weakly typed leaves a step
    with init's avals; an equal optimizer that never ran init left it weak,
    so a restored state retraced the step."""
    inner = optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1)

    def build():
        if wrap == "multi_steps":
            return optax_ext.MultiSteps(inner, 1)
        return optax_ext.skip_when(inner)

    def hyperparams(state):
        inner_state = state.inner_opt_state if wrap == "multi_steps" else state
        return inner_state.hyperparams

    def written(state):
        value = {**hyperparams(state), "learning_rate": jnp.asarray(1e-2)}  # weak
        if wrap == "multi_steps":
            return state._replace(
                inner_opt_state=state.inner_opt_state._replace(hyperparams=value)
            )
        return state._replace(hyperparams=value)

    kwargs = {} if wrap == "multi_steps" else {"skip": False}
    ran_init = build()
    state = written(ran_init.init(P))
    fresh = build()
    assert fresh == ran_init
    outs = [jax.jit(opt.update)(G, state, P, **kwargs) for opt in (ran_init, fresh)]
    for _, new_state in outs:
        lr = hyperparams(new_state)["learning_rate"]
        assert not lr.weak_type and lr.dtype == jnp.float32
    _same_bits(outs[0], outs[1])


@pytest.mark.parametrize("factory", [optax.sgd, optax.adam])
def test_integer_learning_rate_takes_a_float_hypergradient(factory):
    """`learning_rate=1` was stored as an int32 hyperparameter (the factory
    has no default to say it is a float), so writing a float learning rate
    into the state for a hypergradient was refused; optax takes it."""

    def value_and_grad(inject):
        opt = inject(factory)(learning_rate=1)
        state = opt.init(P)

        @jax.jit
        def loss(lr):
            written = state._replace(
                hyperparams={**state.hyperparams, "learning_rate": lr}
            )
            u, _ = opt.update(G, written, P)
            return jnp.sum(optax.apply_updates(P, u)["w"] ** 2)

        return jax.value_and_grad(loss)(jnp.float32(0.05))

    got = value_and_grad(optax_ext.inject_hyperparams)
    expected = value_and_grad(optax.inject_hyperparams)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_mask_dict_changed_after_building_changes_nothing():
    """A dict given as a mask was compared by a snapshot of its contents but
    used live: changed after building, the optimizer still compared equal
    to one built from the old contents and `jax.jit` kept the old compile,
    while an eager call used the new mask. The arguments are now read once,
    when the optimizer is built. Reference: optax.adamw with the mask as it
    was at building time, jitted."""
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    mask = {"a": True, "b": True}
    build = optax_ext.inject_hyperparams(optax.adamw)
    opt = build(learning_rate=0.1, weight_decay=0.5, mask=mask)
    mask["b"] = False
    assert opt == build(
        learning_rate=0.1, weight_decay=0.5, mask={"a": True, "b": True}
    )

    def f32(x):  # the injected numbers as stored (float32)
        return float(np.float32(x))

    bare = optax.adamw(
        f32(0.1),
        b1=f32(0.9),
        b2=f32(0.999),
        eps=f32(1e-8),
        weight_decay=0.5,
        mask={"a": True, "b": True},
    )
    want = jax.jit(bare.update)(params, bare.init(params), params)[0]
    eager = opt.update(params, opt.init(params), params)[0]
    jitted = jax.jit(opt.update)(params, jax.jit(opt.init)(params), params)[0]
    for got in (eager, jitted):
        np.testing.assert_allclose(got["b"], want["b"], rtol=1e-6)


# -- the XLA mechanisms are part of the configuration -------------------------


def test_mechanisms_are_configuration_and_no_process_state():
    """A `MultiSteps` holds its XLA mechanisms (`xla.configured` changes
    them, for tests and benchmarks): equal ones compare and hash equal,
    differently configured ones unequal, so a jit cache keyed on the
    optimizer compiles each its own form in one process, in any order,
    with no cache cleared: the drop-in's conditional on every platform,
    or on none."""
    from optax_ext._accumulate import xla

    inner = optax.adam(1e-3)
    default = optax_ext.MultiSteps(inner, 3)
    assert default == optax_ext.MultiSteps(inner, 3) == xla.configured(default)
    everywhere = frozenset({"cpu", "cuda", "rocm", "tpu"})
    kept = xla.configured(default, drop_in_conditional_on=everywhere)
    selected = xla.configured(default, drop_in_conditional_on=frozenset())
    again = xla.configured(
        optax_ext.MultiSteps(inner, 3), drop_in_conditional_on=frozenset()
    )
    assert selected == again and hash(selected) == hash(again)
    assert len({default, kept, selected}) == 3

    step = jax.jit(lambda opt, g, s: opt.update(g, s, g), static_argnums=0)
    params = jnp.zeros(5)

    def conditionals(opt):
        compiled = step.lower(opt, params, opt.init(params)).compile()
        return compiled.as_text().count(" conditional(")

    counts = [conditionals(opt) for opt in (kept, selected, again, kept)]
    assert [n > 0 for n in counts] == [True, False, False, True], counts


def test_no_module_clears_jax_caches():
    """A library does not reset the process it runs in."""
    root = pathlib.Path(optax_ext.__file__).parent
    found = [p.name for p in root.rglob("*.py") if "clear_caches" in p.read_text()]
    assert found == []
