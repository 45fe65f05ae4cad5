"""`apply_gradients`: equal to `update` + `optax.apply_updates` for every
optimizer and nesting, in the jitted, donated train step users write; params
untouched (bit for bit) on steps that do not update; Equinox models, vmap and
extra arguments; and the fused step's compiled memory."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    across_programs_exact,
    assert_close_across_programs,
    assert_python_leaves_kept,
    avals,
    model_grads,
    model_with_python_leaves,
    skip_cpu_memory_before_0_10_2,
    xla_cpu_only,
)

import optax_ext

COMPILED = xla_cpu_only("memory analysis of the compiled step")

K = 3
STEPS = 2 * K + 1


def _params():
    return {
        "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4),
        "b": jnp.linspace(0.5, -0.5, 4).astype(jnp.bfloat16),
        "s": jnp.asarray(0.25, jnp.float32),
    }


def _grads(i, params):
    return jax.tree.map(
        lambda p: jnp.cos(3.0 * jnp.arange(p.size).reshape(p.shape) + i).astype(
            p.dtype
        ),
        params,
    )


INNER = {
    "adam": lambda: optax.adam(1e-2),
    "lion": lambda: optax.lion(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "sgd-nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "clip+adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2)
    ),
}
ms = optax_ext.MultiSteps
sw = optax_ext.skip_when
WRAPPERS = {
    "bare": lambda o: o,
    "MultiSteps": lambda o: ms(o, K),
    "MultiSteps.gradient_transformation": lambda o: ms(o, K).gradient_transformation(),
    "MultiSteps^2": lambda o: ms(ms(o, 2), 2),
    "skip_when": lambda o: sw(o),
    "MultiSteps(skip_when)": lambda o: ms(sw(o), K),
    "skip_when(MultiSteps)": lambda o: sw(ms(o, K)),
    "chain(zero_nans, MultiSteps)": lambda o: optax.chain(
        optax_ext.zero_nans(), ms(o, K)
    ),
}


# Rounding steps on the path to an entry of one step, with room: adam's
# update is about 20 elementwise roundings, the global norm of clip a 17-term
# sum (16) and its sqrt and scale, adafactor's factored moments 3- and
# 4-term means and an RMS over a 12-entry leaf; the final add is one more.
OPS_PER_STEP = 64


def _skips(name, i):
    """The `skip=` flag of step `i` (every third step skipped), if any."""
    if "skip_when" not in name:
        return {}
    return {"skip": jnp.asarray(i % 3 == 1)}


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_equals_update_then_apply_updates(inner, wrapper):
    """Params and state after each of 7 jitted, donated steps equal those of
    `update` + `optax.apply_updates` jitted the same way. On XLA:CPU: the
    state bit for bit, float32 params within 1e-6 relative (XLA may fuse the
    final add differently), bf16 params bit for bit. Elsewhere the two
    programs are fused differently throughout: params and state within the
    bound of `assert_close_across_programs` for the steps taken."""
    opt = WRAPPERS[wrapper](INNER[inner]())

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def reference(params, state, grads, extra):
        updates, state = opt.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def fused(params, state, grads, extra):
        return optax_ext.apply_gradients(opt, grads, state, params, **extra)

    p_ref, p_new = _params(), _params()
    s_ref, s_new = opt.init(p_ref), opt.init(p_new)
    for i in range(STEPS):
        extra = _skips(wrapper, i)
        p_ref, s_ref = reference(p_ref, s_ref, _grads(i, _params()), extra)
        p_new, s_new = fused(p_new, s_new, _grads(i, _params()), extra)
        for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_new), strict=True):
            assert jax.typeof(a) == jax.typeof(b)
        ops = (i + 1) * OPS_PER_STEP
        assert_close_across_programs(s_new, s_ref, ops=ops, err_msg=f"state {i}")
        if not across_programs_exact():
            assert_close_across_programs(p_new, p_ref, ops=ops, err_msg=f"params {i}")
            continue
        for path, a, b in zip(
            jax.tree_util.tree_leaves_with_path(p_ref),
            jax.tree.leaves(p_ref),
            jax.tree.leaves(p_new),
            strict=True,
        ):
            assert a.dtype == b.dtype, path
            if a.dtype == jnp.bfloat16:
                np.testing.assert_array_equal(
                    np.asarray(a, np.float32), np.asarray(b, np.float32)
                )
            else:
                np.testing.assert_allclose(b, a, rtol=1e-6, atol=0, err_msg=str(path))


@pytest.mark.parametrize(
    "wrapper", ["MultiSteps", "MultiSteps(skip_when)", "skip_when"]
)
def test_params_untouched_when_nothing_updates(wrapper):
    """A mini-step or a skipped step gives back the params bit for bit (no
    `p + 0` that would turn -0.0 into 0.0 or a NaN param into anything)."""
    opt = WRAPPERS[wrapper](optax.adam(1e-2))
    params = {"w": jnp.asarray([-0.0, jnp.nan, 1e-30, -3.0], jnp.float32)}
    state = opt.init(params)
    step = jax.jit(lambda p, s, g, e: optax_ext.apply_gradients(opt, g, s, p, **e))
    extra = {"skip": jnp.asarray(True)} if "skip_when" in wrapper else {}
    new, _ = step(params, state, {"w": jnp.ones(4)}, extra)
    np.testing.assert_array_equal(
        np.asarray(new["w"]).view(np.uint32), np.asarray(params["w"]).view(np.uint32)
    )


def test_equinox_model():
    """A whole Equinox model (an MLP: activation functions among its leaves)
    with gradients from `eqx.filter_grad`: the same model as
    `eqx.apply_updates` after `update`, over a window of MultiSteps."""
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    x = jnp.linspace(-1, 1, 15).reshape(5, 3)
    opt = optax_ext.MultiSteps(optax.adam(1e-2), 2)

    @eqx.filter_grad
    def grad(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    @eqx.filter_jit
    def reference(model, state, x):
        updates, state = opt.update(grad(model, x), state, model)
        return eqx.apply_updates(model, updates), state

    @eqx.filter_jit
    def fused(model, state, x):
        return optax_ext.apply_gradients(opt, grad(model, x), state, model)

    m_ref = m_new = model
    s_ref = s_new = opt.init(eqx.filter(model, eqx.is_array))
    for i in range(4):
        m_ref, s_ref = reference(m_ref, s_ref, x + i)
        m_new, s_new = fused(m_new, s_new, x + i)
    assert m_new.activation is model.activation
    for a, b in zip(
        jax.tree.leaves(eqx.filter(m_ref, eqx.is_array)),
        jax.tree.leaves(eqx.filter(m_new, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    # two windows ran: the model moved
    assert not np.allclose(m_new.layers[0].weight, model.layers[0].weight)


# Every form `apply_gradients` takes, over an Equinox model whose leaves are
# not all arrays. `init` takes the model where the outermost transformation
# is this package's; plain optax cannot build state for an activation
# function (equinox #590), so it takes the model's floating arrays, as in
# Equinox's examples. adamw's weight decay would move `Dropout.p` if its
# inner update (of the zero gradient that `update` gives it) were applied.
_adamw = functools.partial(optax.adamw, 1e-2, weight_decay=0.5)
_injected = functools.partial(optax_ext.inject_hyperparams(optax.adamw), 1e-2)
EQX_OPTIMIZERS = {
    "adamw": (lambda: _adamw(), "arrays"),
    "skip_when": (lambda: sw(_adamw()), "model"),
    "MultiSteps": (lambda: ms(_adamw(), 2), "model"),
    "skip_when(MultiSteps)": (lambda: sw(ms(_adamw(), 2)), "model"),
    "MultiSteps(skip_when)": (lambda: ms(sw(_adamw()), 2), "model"),
    "chain(zero_nans, adamw)": (
        lambda: optax.chain(optax_ext.zero_nans(), _adamw()),
        "arrays",
    ),
    "chain(zero_nans, skip_when)": (
        lambda: optax.chain(optax_ext.zero_nans(), sw(_adamw())),
        "model",
    ),
    "MultiSteps(chain(zero_nans, adamw))": (
        lambda: ms(optax.chain(optax_ext.zero_nans(), _adamw()), 2),
        "model",
    ),
    "inject_hyperparams": (lambda: _injected(weight_decay=0.5), "model"),
    "skip_when(inject_hyperparams)": (
        lambda: sw(_injected(weight_decay=0.5)),
        "model",
    ),
    "MultiSteps(inject_hyperparams)": (
        lambda: ms(_injected(weight_decay=0.5), 2),
        "model",
    ),
}


@pytest.mark.parametrize("name", EQX_OPTIMIZERS)
def test_equinox_model_with_python_leaves_equals_update_then_apply(name):
    """Issue 40: for a model with an `eqx.nn.Dropout` (a Python float `p`,
    `None` gradient), an activation function and a Python int, each form of
    the fused step gives the params and state of `update` +
    `eqx.apply_updates` (both under `eqx.filter_jit`) over 4 steps, one of
    them skipped where there is a `skip_when`, and keeps the leaves that are
    not arrays as they were. `skip_when` fused raised a pytree structure
    error here."""
    make, init_from = EQX_OPTIMIZERS[name]
    opt = make()

    @eqx.filter_jit
    def reference(model, state, grads, extra):
        updates, state = opt.update(grads, state, model, **extra)
        return eqx.apply_updates(model, updates), state

    @eqx.filter_jit
    def fused(model, state, grads, extra):
        return optax_ext.apply_gradients(opt, grads, state, model, **extra)

    model = m_ref = m_new = model_with_python_leaves()
    state = opt.init(
        model if init_from == "model" else eqx.filter(model, eqx.is_inexact_array)
    )
    s_ref = s_new = state
    for i in range(4):
        extra = _skips(name, i)
        m_ref, s_ref = reference(m_ref, s_ref, model_grads(m_ref, i), extra)
        m_new, s_new = fused(m_new, s_new, model_grads(m_new, i), extra)
        assert_python_leaves_kept(m_new, model)
        assert_python_leaves_kept(m_ref, model)
        assert avals(s_new) == avals(s_ref)
        ops = (i + 1) * OPS_PER_STEP
        assert_close_across_programs(s_new, s_ref, ops=ops, err_msg=f"state {i}")
        p_new, p_ref = (eqx.filter(m, eqx.is_array) for m in (m_new, m_ref))
        if not across_programs_exact():
            assert_close_across_programs(p_new, p_ref, ops=ops, err_msg=f"params {i}")
            continue
        for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_new), strict=True):
            # The final add may fuse apart: float32 within 1e-6 relative.
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=0, err_msg=f"params {i}")
    # the model moved
    assert not np.allclose(m_new.linear.weight, model.linear.weight)


def test_vmap_over_independent_runs():
    """Under `vmap` (a batched window decision: the `cond` becomes a
    select), each member equals its own unbatched run."""
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K)
    batch = 3
    params = jax.tree.map(
        lambda x: jnp.stack([x * (j + 1) for j in range(batch)]), _params()
    )
    state = jax.vmap(opt.init)(params)
    # members start at different mini-steps, so their windows differ
    state = state._replace(mini_step=jnp.arange(batch, dtype=jnp.int32))
    step = jax.jit(jax.vmap(lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p)))
    single = jax.jit(lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p))

    def member(tree, j):
        return jax.tree.map(lambda x: x[j], tree)

    members = [(member(params, j), member(state, j)) for j in range(batch)]
    for _ in range(STEPS):
        grads = jax.tree.map(jnp.sin, params)
        params, state = step(params, state, grads)
        members = [single(p, s, member(grads, j)) for j, (p, s) in enumerate(members)]
    for j, (p, _) in enumerate(members):
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(
                np.asarray(b[j], np.float32), np.asarray(a, np.float32), rtol=1e-6
            )


def test_any_other_optimizer_is_update_then_apply():
    """An optimizer the function cannot fuse (here a plain chain) gives
    exactly `update` + `optax.apply_updates`, Python-scalar params too."""
    opt = optax.chain(optax.clip(0.5), optax.sgd(0.1))
    params = {"w": jnp.ones(3), "s": 0.5}
    grads = {"w": jnp.asarray([1.0, -2.0, 3.0]), "s": 2.0}
    state = opt.init(params)
    new, _ = optax_ext.apply_gradients(opt, grads, state, params)
    updates, _ = opt.update(grads, state, params)
    expected = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["w"], expected["w"])
    np.testing.assert_array_equal(new["s"], expected["s"])


def test_extra_args_reach_the_inner_optimizer():
    """Extra keyword arguments go to the inner optimizer through the fused
    path: `value=` for reduce_on_plateau inside MultiSteps gives the params
    of `update` + `apply_updates` with the same values, and other values
    give other params (the argument is used)."""
    inner = optax.chain(
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    )
    opt = optax_ext.MultiSteps(inner, 1)
    grads = {"w": jnp.ones(2)}

    def run(step, values):
        params = {"w": jnp.zeros(2)}
        state = opt.init(params)
        for v in values:
            params, state = step(params, state, jnp.asarray(v))
        return params["w"]

    fused = jax.jit(
        lambda p, s, v: optax_ext.apply_gradients(opt, grads, s, p, value=v)
    )

    @jax.jit
    def reference(p, s, v):
        updates, s = opt.update(grads, s, p, value=v)
        return optax.apply_updates(p, updates), s

    worsening = [1.0, 2.0, 3.0, 4.0, 5.0]
    np.testing.assert_array_equal(run(fused, worsening), run(reference, worsening))
    improving = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert not np.array_equal(run(fused, worsening), run(fused, improving))


def _temp_over_params(fn, opt, params):
    state = opt.init(params)
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, params).compile()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return compiled.memory_analysis().temp_size_in_bytes / nbytes


@COMPILED
@pytest.mark.parametrize(
    "leaves,shape,inner",
    [
        (leaves, shape, inner)
        for leaves, shape in [(8, (256, 256)), (300, (16, 16))]
        for inner in ["adam", "lion", "sgd-nesterov", "adafactor"]
        # Each inner optimizer on a few large leaves; many small ones (slow
        # to compile) with adam and SGD with Nesterov momentum (Lion's many
        # leaves: the GPT-2-like tree of test_compiled_backends.py).
        if leaves == 8 or inner in ("adam", "sgd-nesterov")
    ],
)
def test_fused_step_has_no_params_sized_temporary(leaves, shape, inner):
    """The fused, donated train step needs no params-sized temporary more
    than the bare optimizer's own train step (the accumulator, the moments
    and the params stay in their donated buffers; the updates are never
    materialised), where the drop-in `update` + `apply_updates` needs
    exactly one more in its conditional: its tree of zero updates.
    (XLA:CPU; XLA:GPU and XLA:TPU: tests/test_compiled_backends.py; the
    whole train step, gradients not passed in: test_train_step_memory.py.)"""
    skip_cpu_memory_before_0_10_2()
    params = {f"w{i:03d}": jnp.zeros(shape, jnp.float32) for i in range(leaves)}
    opt = optax_ext.MultiSteps(INNER[inner](), 4)

    def dropin(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def fused(p, s, g):
        return optax_ext.apply_gradients(opt, g, s, p)

    def bare(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    tx = INNER[inner]()
    fused_temp = _temp_over_params(fused, opt, params)
    dropin_temp = _temp_over_params(dropin, opt, params)
    bare_temp = _temp_over_params(bare, tx, params)
    # (with many small leaves a few scalars and buffer tables per leaf remain:
    # 12% of these 1 KiB leaves).
    assert fused_temp < bare_temp + 0.15, (fused_temp, bare_temp)
    # Adafactor's own temporaries may hold the zero updates.
    if inner != "adafactor":
        assert dropin_temp - fused_temp > 0.98, (dropin_temp, fused_temp)


@COMPILED
def test_fused_for_models_with_python_numbers():
    """Issue 34: a model with Python numbers among its leaves (an Equinox
    model with `eqx.nn.Dropout`: `p`, `inference`) is fused: they stay
    outside the conditional, the mini-step builds no zero updates (its
    compiled temporary memory is that of the model without the Dropout,
    0.00x the params, where it was 1.00x applied unfused), the numbers come
    back as the Python numbers they were, and the params are the unfused
    step's (update + `eqx.apply_updates`, jitted alike; the two programs
    compile apart, so to the last float32 bit: a relative 1e-6)."""

    class Model(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

    key = jax.random.key(0)
    model = Model(eqx.nn.Linear(256, 256, key=key), eqx.nn.Dropout(0.25))
    opt = optax_ext.MultiSteps(optax.adam(1e-2), 2)
    arrays, static = eqx.partition(model, eqx.is_array)

    def fused(arrays, state, grads):
        m = eqx.combine(arrays, static)
        new, state = optax_ext.apply_gradients(opt, grads, state, m)
        assert new.dropout.p == 0.25 and new.dropout.inference is False
        return eqx.filter(new, eqx.is_array), state

    def unfused(arrays, state, grads):
        m = eqx.combine(arrays, static)
        updates, state = opt.update(grads, state, m)
        return eqx.filter(eqx.apply_updates(m, updates), eqx.is_array), state

    grads = jax.tree.map(lambda a: jnp.full_like(a, 0.5), arrays)
    state = opt.init(model)
    compiled = (
        jax.jit(fused, donate_argnums=(0, 1)).lower(arrays, state, grads).compile()
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(arrays))
    skip_cpu_memory_before_0_10_2()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.02 * nbytes
    got, want = (arrays, state), (arrays, state)
    step_f, step_u = jax.jit(fused), jax.jit(unfused)
    for _ in range(4):
        got = step_f(got[0], got[1], grads)
        want = step_u(want[0], want[1], grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
