"""The three transformations composed with optax's combinators, with each
other, with Flax's TrainState and with Equinox. References are computed by
hand (sgd with learning rate 1 emits minus the window mean) or with plain
optax on the averaged gradients."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_exact_zeros

import optax_ext

nan = float("nan")
G = [
    {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])},
    {"a": jnp.array([3.0, nan]), "b": jnp.array([5.0])},
    {"a": jnp.array([5.0, 6.0]), "b": jnp.array([7.0])},
    {"a": jnp.array([7.0, 8.0]), "b": jnp.array([9.0])},
]
P = {"a": jnp.zeros(2), "b": jnp.zeros(1)}


def _run(tx, grads=G, params=P, jit=True):
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    outs = []
    for g in grads:
        u, state = update(g, state, params)
        outs.append(u)
    return outs, state


def _within_one_ulp(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        a, b = np.asarray(a), np.asarray(b)
        assert (np.abs(a - b) <= np.spacing(np.abs(b))).all(), (a, b)


def _close(got, want):
    """float32 results against a float64 (or exact) reference."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=0
        )


def _ms(inner, k=2, **kw):
    return optax_ext.MultiSteps(inner, every_k_schedule=k, **kw)


def test_demo_composition_equals_adamw_on_mean():
    """MultiSteps(chain(zero_nans, inject(adamw))) == adamw on the NaN-zeroed
    window means."""
    sched = optax.linear_schedule(0.1, 0.01, 4)
    mask = {"a": True, "b": False}
    tx = _ms(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.adamw)(
                sched, weight_decay=0.1, mask=mask
            ),
        )
    )
    outs, _ = _run(tx)
    # The reference: bare optax.adamw on the window means, which are exact
    # in float32 here (halves of sums of small integers), given the float32
    # hyperparameters inject_hyperparams holds (see docs/inject_hyperparams.md):
    # the only arithmetic is adamw's own, in float32 as optax_ext's. (This
    # compared at rtol 1e-5; a float64 adamw differs by 3e-6 relative at
    # the second window, float32 `1 - 0.999**2` alone being off by 3e-5, so
    # float64 cannot be the reference here.)
    # Measured: equal at the first window, 1 ulp apart at the second.

    def f32(x):
        return float(np.float32(x))

    ref = optax.adamw(
        sched,
        b1=f32(0.9),
        b2=f32(0.999),
        eps=f32(1e-8),
        weight_decay=f32(0.1),
        mask=mask,
    )
    rs = ref.init(P)
    ref_update = jax.jit(ref.update)  # jitted as `_run` is
    for i in (1, 3):
        mean = jax.tree.map(
            lambda x, y: jnp.nan_to_num((x + y) / 2, nan=0.0), G[i - 1], G[i]
        )
        want, rs = ref_update(mean, rs, P)
        _within_one_ulp(outs[i], want)
        assert_exact_zeros(outs[i - 1])


def test_chain_named_chain_masked_partition():
    zero_nans_sgd = optax.chain(optax_ext.zero_nans(), optax.sgd(1.0))
    mean1 = {"a": np.array([-2.0, 0.0]), "b": np.array([-4.0])}  # nan zeroed
    for tx in [
        optax.chain(optax.identity(), _ms(zero_nans_sgd)),
        optax.named_chain(("ms", _ms(zero_nans_sgd)), ("id", optax.identity())),
        _ms(optax.named_chain(("zn", optax_ext.zero_nans()), ("sgd", optax.sgd(1.0)))),
    ]:
        outs, _ = _run(tx)
        _close(outs[1], mean1)

    # masked: only "a" is accumulated; "b" passes through unchanged.
    outs, _ = _run(optax.masked(_ms(zero_nans_sgd), {"a": True, "b": False}))
    np.testing.assert_array_equal(outs[0]["a"], [0.0, 0.0])
    np.testing.assert_array_equal(outs[0]["b"], G[0]["b"])
    np.testing.assert_array_equal(outs[1]["a"], [-2.0, 0.0])

    # partition: "a" accumulated over 2, "b" over 4 (mean of 3, 5, 7, 9).
    tx = optax.partition(
        {"two": _ms(zero_nans_sgd, 2), "four": _ms(optax.sgd(1.0), 4)},
        {"a": "two", "b": "four"},
    )
    outs, _ = _run(tx)
    np.testing.assert_array_equal(outs[1]["a"], [-2.0, 0.0])
    np.testing.assert_array_equal(outs[1]["b"], [0.0])
    np.testing.assert_array_equal(outs[3]["b"], [-6.0])


def test_apply_if_finite_both_ways():
    # Outside: the NaN window's emitted update is non-finite, so
    # apply_if_finite drops it and restores the state from before that step:
    # the window still holds G[0] and completes with G[2].
    outs, state = _run(optax.apply_if_finite(_ms(optax.sgd(1.0)), 5))
    assert_exact_zeros(outs[1])
    np.testing.assert_array_equal(outs[2]["a"], [-3.0, -4.0])
    assert_exact_zeros(outs[3])
    # Inside: the window mean with NaN reaches apply_if_finite, which skips it.
    outs, state = _run(_ms(optax.apply_if_finite(optax.sgd(1.0), 5)))
    assert_exact_zeros(outs[1])
    np.testing.assert_array_equal(outs[3]["a"], [-6.0, -7.0])
    assert int(state.inner_opt_state.total_notfinite) == 1


def test_multi_steps_nested_in_multi_steps_and_in_inject():
    grads = [{"w": jnp.array([float(i)])} for i in range(1, 13)]
    params = {"w": jnp.zeros(1)}
    outs, _ = _run(_ms(_ms(optax.sgd(1.0), 2), 3), grads, params)
    emitted = [float(u["w"][0]) for u in outs]
    assert emitted == [0.0] * 5 + [-3.5] + [0.0] * 5 + [-9.5]

    def accumulated_sgd(learning_rate):
        return _ms(optax.sgd(learning_rate), 2).gradient_transformation()

    tx = optax_ext.inject_hyperparams(accumulated_sgd)(
        learning_rate=optax.linear_schedule(1.0, 0.0, 4)
    )
    outs, state = _run(tx, grads[:4], params)
    # The factory is rebuilt every step from the state: the learning rate of
    # the emitting step applies to the window mean.
    assert [float(u["w"][0]) for u in outs] == [0.0, -1.5 * 0.75, 0.0, -3.5 * 0.25]


def test_inject_inside_zero_nans_chain_inside_multi_steps_bf16():
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = _ms(
        optax.chain(
            optax_ext.zero_nans(), optax_ext.inject_hyperparams(optax.adam)(1e-2)
        ),
        k=2,
    )
    grads = [
        {"w": jnp.array([0.1, nan, 0.3], jnp.bfloat16)},
        {"w": jnp.full(3, 0.1, jnp.bfloat16)},
    ]
    outs, state = _run(tx, grads, params)
    assert outs[1]["w"].dtype == jnp.bfloat16
    assert bool(jnp.isfinite(outs[1]["w"].astype(jnp.float32)).all())
    found = state.inner_opt_state[0].found_nan["w"]
    assert found.dtype == jnp.bool_ and bool(found)


def test_flax_train_state():
    train_state = pytest.importorskip("flax.training.train_state")
    tx = _ms(optax.chain(optax_ext.zero_nans(), optax.sgd(1.0)))
    state = train_state.TrainState.create(
        apply_fn=None, params=P, tx=tx.gradient_transformation()
    )
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for g in G[:2]:
        state = step(state, g)
    np.testing.assert_array_equal(state.params["a"], [-2.0, 0.0])
    np.testing.assert_array_equal(state.params["b"], [-4.0])


def test_equinox_filter_jit_and_apply_updates():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    tx = _ms(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.adamw)(
                1e-1, mask=jax.tree.map(lambda _: True, model)
            ),
        ),
        k=2,
    )
    state = tx.init(model)

    @eqx.filter_jit
    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        )(model)
        updates, state = tx.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    x = jax.random.normal(jax.random.key(1), (16, 2))
    y = x @ jnp.array([[1.0], [-2.0]]) + 0.5
    losses = []
    for _ in range(40):
        model, state, loss = step(model, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0]


def _traces_over_rebuilds(make, forms):
    """Traces of a jitted step taking the optimizer as a static argument,
    over three optimizers built by `make`, each stepped in its `forms`."""
    traces = []

    @jax.jit(static_argnums=0)
    def step(opt, state, g):
        traces.append(None)
        return opt.update(g, state, P)

    state = make().init(P)
    for _ in range(3):
        for opt in forms(make()):
            _, state = step(opt, state, G[0])
    return len(traces)


def test_equal_configurations_do_not_recompile():
    """upstream-optax.md item 10: two optimizers built alike are equal and hash
    alike, so a step taking the optimizer as a static argument compiles once."""

    def make(lr=1e-2, k=2):
        # (optax.chain builds a new closure each call, so a chain is only
        # equal to itself: compose with chain once, outside the loop.)
        inner = optax_ext.inject_hyperparams(optax.adam)(lr)
        return optax_ext.MultiSteps(inner, every_k_schedule=k)

    # One trace for MultiSteps, one for its GradientTransformation.
    assert (
        _traces_over_rebuilds(make, lambda opt: (opt, opt.gradient_transformation()))
        == 2
    )
    assert make() == make() and hash(make()) == hash(make())
    assert make(lr=1e-3) != make() and make(k=3) != make()
    assert optax_ext.zero_nans() == optax_ext.zero_nans()
    # Upstream: every new optimizer is a new static argument.
    assert optax.adam(1e-2) != optax.adam(1e-2)


def test_equal_masks_and_array_scalars_make_equal_optimizers():
    """A Flax-style dict of bools as a mask, or a learning rate given as
    `jnp.float32(...)`, made two optimizers built alike compare unequal (by
    identity), so a step taking the optimizer as a static argument compiled
    again for each. They compare by value now; a larger array still by
    identity, and a different value or dtype is a different optimizer."""

    def make(lr=None, mask=None, k=2):
        lr = jnp.float32(1e-2) if lr is None else lr
        mask = {"a": True, "b": False} if mask is None else mask
        inner = optax_ext.inject_hyperparams(optax.adamw)(lr, mask=mask)
        return optax_ext.MultiSteps(inner, every_k_schedule=k)

    assert make() == make() and hash(make()) == hash(make())
    assert make(lr=jnp.float32(1e-3)) != make()
    assert make(lr=jnp.bfloat16(1e-2)) != make()
    assert make(mask={"a": True, "b": True}) != make()
    vector = jnp.full(2, 1e-2)
    assert optax_ext.inject_hyperparams(optax.sgd)(vector) == (
        optax_ext.inject_hyperparams(optax.sgd)(vector)
    )
    assert optax_ext.inject_hyperparams(optax.sgd)(vector) != (
        optax_ext.inject_hyperparams(optax.sgd)(jnp.full(2, 1e-2))
    )

    assert _traces_over_rebuilds(make, lambda opt: (opt,)) == 1


class _Indexed(eqx.Module):
    """A model with an integer buffer and a PRNG key: `eqx.filter_grad` gives
    None for both, so every state must hold None there too."""

    w: jax.Array
    idx: jax.Array
    key: jax.Array
    act: object = jax.nn.relu

    def __call__(self, x):
        return jnp.sum(self.act(self.w[self.idx] * x))


def test_models_with_integer_buffers_and_keys():
    model = _Indexed(
        jnp.array([1.0, -2.0, 3.0]), jnp.array([2, 0, 1]), jax.random.key(0)
    )
    tx = _ms(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.sgd)(1.0),
        ),
        k=2,
    )
    state = tx.init(model)

    @eqx.filter_jit
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: m(x))(model)
        assert grads.idx is None and grads.key is None
        updates, state = tx.update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    x = jnp.array([1.0, nan, 1.0])
    model, state = step(model, state, x)
    model, state = step(model, state, jnp.ones(3))
    # w[idx] = [3, 1, -2]: relu passes entries 0 and 1, so d/dw = x[1] at w[0],
    # x[0] at w[2], 0 at w[1]. Window mean: w[0] gets (nan + 1) / 2, zeroed by
    # zero_nans; w[2] gets (1 + 1) / 2.
    np.testing.assert_allclose(model.w, [1.0, -2.0, 3.0 - 1.0])
    np.testing.assert_array_equal(model.idx, [2, 0, 1])
    found = state.inner_opt_state[0].found_nan
    assert found.idx is None and found.key is None and bool(found.w)


def _signature_pairs():
    return {
        "zero_nans": (optax_ext.zero_nans(), optax.zero_nans()),
        "inject_hyperparams": (
            optax_ext.inject_hyperparams(optax.adam)(learning_rate=0.1),
            optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
        ),
        "MultiSteps": (
            optax_ext.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
            optax.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
        ),
    }


@pytest.mark.parametrize("name", ["zero_nans", "inject_hyperparams", "MultiSteps"])
def test_update_takes_optax_s_argument_names_and_donates_by_name(name):
    """`update`'s arguments have optax's names (zero_nans' state argument
    is `opt_state` there), and `jax.jit(update, donate_argnames=...)`
    donates the state: the wrapped methods took `*args`, so JAX could not
    map the name and silently donated nothing."""
    ours, theirs = _signature_pairs()[name]
    names = list(inspect.signature(theirs.update).parameters)
    assert list(inspect.signature(ours.update).parameters) == names
    params = {"w": jnp.ones(8)}
    deleted = []
    for opt in (ours, theirs):
        state = opt.init(params)
        jax.jit(opt.update, donate_argnames=names[1])(params, state, params)
        deleted.append([x.is_deleted() for x in jax.tree.leaves(state)])
    assert deleted[0] == deleted[1]
    if name != "zero_nans":  # whose scalar bools XLA:CPU does not alias
        assert all(deleted[0])
    # And by keyword, as optax's own update is called.
    ours.update(params, **{names[1]: ours.init(params)}, params=params)
