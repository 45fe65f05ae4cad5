"""Flax NNX: `MultiSteps` through `nnx.Optimizer`, the fused step
`nnx_apply_gradients` (with `emit=` and `weight=`), `microbatched` with a
module argument inside `nnx.jit`, and checkpoints of `nnx.state` with orbax.

The references are independent of optax_ext: `optax.MultiSteps` through
`nnx.Optimizer`, the inner optax optimizer applied to each window's mean
gradient computed directly (float64, rounded once), `nnx.value_and_grad` on
the whole batch, and an uninterrupted run.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_float32_close, assert_same_arithmetic

import optax_ext

nnx = pytest.importorskip("flax.nnx")

K, WINDOWS, LR = 3, 3, 0.05
EPS = float(np.finfo(np.float32).eps)


class Model(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))[..., 0]


def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _data(steps, rows=8):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, rows, 3)).astype(np.float32)
    ys = rng.normal(size=(steps, rows)).astype(np.float32)
    return xs, ys


XS, YS = _data(K * WINDOWS)
# Uneven per-step weights (token counts), one of them 0.
WEIGHTS = [3.0, 0.0, 5.0, 1.0, 4.0, 2.0, 6.0, 1.0, 0.5]


@nnx.jit
def drop_in_step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(loss)(model, x, y))


@nnx.jit
def fused_step(model, optimizer, x, y, **extra):
    grads = nnx.grad(loss)(model, x, y)
    optax_ext.nnx_apply_gradients(optimizer, model, grads, **extra)


def _emit_step(model, optimizer, x, y, emit):
    grads = nnx.grad(loss)(model, x, y)
    optax_ext.nnx_apply_gradients(optimizer, model, grads, emit=emit)


emit_step = nnx.jit(_emit_step, static_argnames="emit")


def _leaves(tree):
    """A copy of the leaves of `tree` as NumPy arrays."""
    return [np.array(x) for x in jax.tree.leaves(tree)]


def params_of(model):
    """A copy of the model's params (`nnx.state`'s leaves follow it)."""
    return [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def run(tx, step, steps=range(K * WINDOWS), model=None, optimizer=None):
    """The params after each window's last step, and the model and optimizer."""
    model = Model() if model is None else model
    if optimizer is None:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    after_windows = []
    for t in steps:
        step(model, optimizer, t)
        if t % K == K - 1:
            after_windows.append(params_of(model))
    return after_windows, model, optimizer


def plain(step):
    return lambda model, optimizer, t: step(model, optimizer, XS[t], YS[t])


def assert_moved(windows, part=None):
    """Every window changed the params (of `part`, a submodule's name, if
    given): a reference that did nothing would compare equal to a run that
    did nothing."""
    model = Model()
    before = params_of(model if part is None else getattr(model, part))
    for params in windows:
        assert any(
            not np.array_equal(a, b) for a, b in zip(params, before, strict=True)
        )
        before = params


def weighted_mean(values, weights):
    """`sum w_i x_i / sum w_i` in float64, rounded once to float32."""
    total = sum(
        w * np.asarray(x, np.float64) for w, x in zip(weights, values, strict=True)
    )
    return (total / sum(weights)).astype(np.float32)


def direct_reference(weights=None):
    """The inner optimizer (adam) on each window's mean gradient (weighted
    mean with `weights`), computed in float64 from per-step gradients and
    rounded once: no MultiSteps, no nnx.Optimizer."""
    graphdef, params = nnx.split(Model(), nnx.Param)
    params = nnx.as_pure(params)
    grad = jax.jit(
        lambda p, x, y: jax.grad(lambda p: loss(nnx.merge(graphdef, p), x, y))(p)
    )
    inner = optax.adam(LR)
    state, out = inner.init(params), []
    for w in range(WINDOWS):
        steps = range(w * K, (w + 1) * K)
        grads = [grad(params, XS[t], YS[t]) for t in steps]
        ws = [1.0] * K if weights is None else [weights[t] for t in steps]
        mean = jax.tree.map(lambda *g, ws=ws: weighted_mean(g, ws), *grads)
        updates, state = jax.jit(inner.update)(mean, state, params)
        params = optax.apply_updates(params, updates)
        out.append([np.array(x) for x in jax.tree.leaves(params)])
    return out


# --- the package without flax ---------------------------------------------------


def test_import_optax_ext_imports_no_flax():
    code = (
        "import sys, optax_ext\n"
        "assert optax_ext.nnx_apply_gradients\n"
        "loaded = [m for m in sys.modules if m == 'flax' or m.startswith('flax.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- MultiSteps through nnx.Optimizer ------------------------------------------


def test_drop_in_through_nnx_optimizer_equals_optax_multisteps():
    """`optax_ext.MultiSteps` in place of `optax.MultiSteps` in
    `nnx.Optimizer`: the params after each window are equal bit for bit at
    XLA:CPU -O0, within float32 rounding at XLA's default level (the two
    compile the inner step apart: 0 to 1 ulp after the first window, 1 to
    7 after later ones, as measured); the counters are equal."""
    want, _, ref_opt = run(optax.MultiSteps(optax.adam(LR), K), plain(drop_in_step))
    got, _, opt = run(optax_ext.MultiSteps(optax.adam(LR), K), plain(drop_in_step))
    assert_moved(want)
    for g, w in zip(got, want, strict=True):
        assert_same_arithmetic(g, w)
    assert int(opt.step[...]) == int(ref_opt.step[...]) == K * WINDOWS
    assert int(opt.opt_state.gradient_step[...]) == WINDOWS
    assert int(opt.opt_state.mini_step[...]) == int(ref_opt.opt_state.mini_step[...])


# --- the fused step ----------------------------------------------------------


def test_fused_step_equals_drop_in_and_the_inner_optimizer_on_the_mean():
    """`nnx_apply_gradients` against `optax_ext.MultiSteps` through
    `nnx.Optimizer.update` (params after each window; the params kept as they
    are on mini-steps; the step counter and the state's structure, so a
    checkpoint of one loads in the other), and against adam on each window's
    mean gradient computed directly."""
    drop_in, _, ref_opt = run(
        optax_ext.MultiSteps(optax.adam(LR), K), plain(drop_in_step)
    )
    model = Model()
    optimizer = nnx.Optimizer(
        model, optax_ext.MultiSteps(optax.adam(LR), K), wrt=nnx.Param
    )
    fused = []
    for t in range(K * WINDOWS):
        before = params_of(model)
        fused_step(model, optimizer, XS[t], YS[t])
        if t % K != K - 1:  # a mini-step leaves the params as they were
            for a, b in zip(params_of(model), before, strict=True):
                np.testing.assert_array_equal(a, b)
        else:
            fused.append(params_of(model))
    assert_moved(fused)
    for f, d, r in zip(fused, drop_in, direct_reference(), strict=True):
        assert_same_arithmetic(f, d)
        assert_float32_close(f, r)
    assert int(optimizer.step[...]) == int(ref_opt.step[...]) == K * WINDOWS
    assert jax.tree.structure(nnx.state(optimizer)) == jax.tree.structure(
        nnx.state(ref_opt)
    )


def test_emit_equals_the_fused_step():
    """`emit=` chosen on the host (`t % K == K - 1`) gives the fused step's
    params (bit for bit on XLA:CPU, at -O0 and at the default level as
    measured; asserted where `SAME_BITS`), and the same counters."""
    tx = optax_ext.MultiSteps(optax.adam(LR), K)
    want, _, ref_opt = run(tx, plain(fused_step))

    def step(model, optimizer, t):
        emit_step(model, optimizer, XS[t], YS[t], emit=t % K == K - 1)

    got, _, opt = run(optax_ext.MultiSteps(optax.adam(LR), K), step)
    assert_moved(got)
    for g, w in zip(got, want, strict=True):
        assert_same_arithmetic(g, w)
    assert int(opt.step[...]) == int(ref_opt.step[...])
    assert int(opt.opt_state.gradient_step[...]) == WINDOWS
    # The host decides: emit=True on a window's first step ends it there,
    # on that step's gradient alone (the fused step would only accumulate).
    model = Model()
    optimizer = nnx.Optimizer(
        model, optax_ext.MultiSteps(optax.adam(LR), K), wrt=nnx.Param
    )
    emit_step(model, optimizer, XS[0], YS[0], emit=True)
    assert int(optimizer.opt_state.gradient_step[...]) == 1
    reference = Model()  # adam itself, through nnx.Optimizer
    drop_in_step(
        reference, nnx.Optimizer(reference, optax.adam(LR), wrt=nnx.Param), XS[0], YS[0]
    )
    assert_moved([params_of(model)])
    assert_float32_close(params_of(model), params_of(reference))


def test_weighted_equals_the_inner_optimizer_on_the_weighted_mean():
    """`MultiSteps(weighted=True)` with `weight=` per step (uneven, one 0)
    through `nnx_apply_gradients`: adam on each window's weighted mean
    gradient computed directly."""

    def step(model, optimizer, t):
        fused_step(model, optimizer, XS[t], YS[t], weight=jnp.float32(WEIGHTS[t]))

    tx = optax_ext.MultiSteps(optax.adam(LR), K, weighted=True)
    got, _, _ = run(tx, step)
    assert_moved(got)
    for g, r in zip(got, direct_reference(WEIGHTS), strict=True):
        assert_float32_close(g, r)


def test_wrt_is_honoured():
    """An optimizer built with `wrt` (the output layer only) updates those
    params only, as `nnx.Optimizer.update` does with the same gradients."""
    wrt = nnx.All(nnx.Param, nnx.PathContains("out"))

    def steps(apply):
        model = Model()
        tx = optax_ext.MultiSteps(optax.adam(LR), K)
        optimizer = nnx.Optimizer(model, tx, wrt=wrt)

        @nnx.jit
        def step(model, optimizer, x, y):
            grads = nnx.grad(loss, argnums=nnx.DiffState(0, wrt))(model, x, y)
            apply(optimizer, model, grads)

        for t in range(K):
            step(model, optimizer, XS[t], YS[t])
        return model, optimizer

    model, optimizer = steps(optax_ext.nnx_apply_gradients)
    ref_model, ref_optimizer = steps(lambda o, m, g: o.update(m, g))
    hidden, out = nnx.state(model.hidden, nnx.Param), nnx.state(model.out, nnx.Param)
    for a, b in zip(_leaves(hidden), _leaves(nnx.state(Model().hidden)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_moved([_leaves(out)], part="out")
    assert_float32_close(_leaves(out), _leaves(nnx.state(ref_model.out, nnx.Param)))
    assert int(optimizer.step[...]) == int(ref_optimizer.step[...]) == K
    assert jax.tree.structure(nnx.state(optimizer)) == jax.tree.structure(
        nnx.state(ref_optimizer)
    )


def test_bad_arguments_raise_before_anything_changes():
    model = Model()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    grads = nnx.grad(loss)(model, XS[0], YS[0])
    before = params_of(model)
    with pytest.raises(
        TypeError, match=r"emit=True .*optimizer\.tx must be an optax_ext\.MultiSteps"
    ):
        optax_ext.nnx_apply_gradients(optimizer, model, grads, emit=True)
    with pytest.raises(
        TypeError,
        match="optimizer must be a flax `nnx.Optimizer`.* got GradientTransformation",
    ):
        optax_ext.nnx_apply_gradients(optax.adam(LR), model, grads)
    with pytest.raises(TypeError, match="model must be the NNX module .* got dict"):
        optax_ext.nnx_apply_gradients(optimizer, {"w": jnp.ones(2)}, grads)
    for a, b in zip(params_of(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.step[...]) == 0
    # Without emit, any optax optimizer works: adam's own step.
    optax_ext.nnx_apply_gradients(optimizer, model, grads)
    assert int(optimizer.step[...]) == 1
    assert_moved([params_of(model)])


# --- microbatched ------------------------------------------------------------


def test_microbatched_takes_a_module_inside_nnx_jit():
    """`microbatched(nnx.value_and_grad(loss), 4)(model, batch)` inside
    `nnx.jit`: the whole batch's loss and gradient (`nnx.value_and_grad`,
    jitted), within float32 rounding, as an `nnx.State` that
    `nnx.Optimizer.update` takes."""
    model = Model()
    x, y = np.concatenate(XS[:2]), np.concatenate(YS[:2])  # 16 rows

    def batch_loss(model, batch):
        return loss(model, *batch)

    @nnx.jit
    def micro(model, batch):
        return optax_ext.microbatched(nnx.value_and_grad(batch_loss), 4)(model, batch)

    @nnx.jit
    def whole(model, batch):
        return nnx.value_and_grad(batch_loss)(model, batch)

    got_loss, got = micro(model, (x, y))
    want_loss, want = whole(model, (x, y))
    assert type(got) is type(want) is nnx.State
    assert jax.tree.structure(got) == jax.tree.structure(want)
    np.testing.assert_allclose(got_loss, want_loss, rtol=8 * EPS)
    assert_float32_close(
        [np.asarray(g) for g in jax.tree.leaves(got)],
        [np.asarray(w) for w in jax.tree.leaves(want)],
        ulps=16,
    )
    # The model itself is as it was, and the gradient updates it.
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = params_of(model)
    optimizer.update(model, got)
    assert_float32_close(
        params_of(model),
        [
            p - 0.1 * np.asarray(w)
            for p, w in zip(before, jax.tree.leaves(want), strict=True)
        ],
    )


def test_microbatched_weight_fn_takes_the_module():
    """`weight_fn` is called with the module too: a token-weighted mean
    (rows masked out) equals the whole batch's masked mean."""
    model = Model()
    x, y = np.concatenate(XS[:2]), np.concatenate(YS[:2])
    mask = np.zeros(16, np.float32)
    mask[[0, 1, 2, 5, 9, 13, 14]] = 1.0  # uneven per micro-batch, one empty

    def masked_loss(model, batch):
        x, y, m = batch
        return jnp.sum(m * (model(x) - y) ** 2) / jnp.maximum(m.sum(), 1.0)

    @nnx.jit
    def micro(model, batch):
        return optax_ext.microbatched(
            nnx.grad(masked_loss), 4, weight_fn=lambda model, b: b[2].sum()
        )(model, batch)

    got = micro(model, (x, y, mask))
    want = nnx.jit(nnx.grad(masked_loss))(model, (x, y, mask))
    assert_float32_close(
        [np.asarray(g) for g in jax.tree.leaves(got)],
        [np.asarray(w) for w in jax.tree.leaves(want)],
        ulps=16,
    )


class NormDropModel(nnx.Module):
    """BatchNorm's running statistics and Dropout's `nnx.Rngs` count: state
    the forward pass changes."""

    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jnp.tanh(self.norm(self.hidden(x)))))[..., 0]


def _other_state(model):
    """The model's state but its params: the statistics and the counts."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    keys = [jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves]
    return [
        np.asarray(jax.random.key_data(x) if key else x)
        for x, key in zip(leaves, keys, strict=True)
    ]


def test_microbatched_carries_module_state_from_micro_batch_to_the_next():
    """What the forward pass changes in the module (BatchNorm's running
    statistics, Dropout's `nnx.Rngs` count) goes from one micro-batch to
    the next and is in the module after the call, as after `k` calls of
    `nnx.value_and_grad` one micro-batch at a time (the reference, each
    call jitted): the same state, each micro-batch its own dropout mask,
    and their gradients' mean (float64, rounded once)."""
    k = 4
    x, y = np.concatenate(XS[:2]), np.concatenate(YS[:2])  # 16 rows

    def batch_loss(model, batch):
        return loss(model, *batch)

    @nnx.jit
    def micro(model, batch):
        return optax_ext.microbatched(nnx.value_and_grad(batch_loss), k)(model, batch)

    one = nnx.jit(nnx.value_and_grad(batch_loss))
    model, reference = NormDropModel(), NormDropModel()
    before = _other_state(model)
    got_loss, got = micro(model, (x, y))
    losses, grads = [], []
    for j in range(k):  # micro-batch j: rows j, j + k, ... (docs/microbatched.md)
        value, g = one(reference, (x[j::k], y[j::k]))
        losses.append(float(value))
        grads.append([np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(g)])
    after = _other_state(model)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    for a, want in zip(after, _other_state(reference), strict=True):
        np.testing.assert_array_equal(a, want)
    np.testing.assert_allclose(got_loss, np.mean(losses), rtol=8 * EPS)
    assert_float32_close(
        [np.asarray(g) for g in jax.tree.leaves(got)],
        [
            np.mean(leaves, axis=0).astype(np.float32)
            for leaves in zip(*grads, strict=True)
        ],
        ulps=16,
    )


class Counter(nnx.Module):
    """Counts its calls in a `BatchStat`."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.n = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return x @ self.w[...]


def test_microbatched_keeps_a_module_shared_by_two_arguments_shared():
    """One module passed twice: both arguments are the one module inside
    `grad_fn`, and it counts every call, as `k` calls in turn do (each
    argument split apart, the last one's count was written back: 4, not 8)."""

    def two(a, x, b):
        return jnp.mean(a(x)) + jnp.mean(b(x))

    model, reference = Counter(), Counter()
    x = np.ones((16, 3), np.float32)
    nnx.jit(optax_ext.microbatched(two, 4))(model, x, model)
    for j in range(4):
        two(reference, x[j::4], reference)
    assert int(model.n[...]) == int(reference.n[...]) == 8


def test_microbatched_keeps_no_trace_state_on_its_objects(monkeypatch):
    """What a trace finds (the leaves `grad_fn` sets) and the loop's output
    are values passed on, not kept on the objects a call builds: each
    call's module carry is as built after `jax.eval_shape` and `jax.jit`
    of a step that calls it, and both give the count of `k` calls."""
    from optax_ext import _microbatched

    made = []

    class Recorded(_microbatched.ModuleCarry):
        def __init__(self, originals):
            super().__init__(originals)
            made.append((self, dict(vars(self))))

    monkeypatch.setattr(_microbatched, "ModuleCarry", Recorded)
    graphdef, state = nnx.split(Counter())
    run = optax_ext.microbatched(lambda m, x: jnp.mean(m(x)), 4)

    def step(state, x):
        model = nnx.merge(graphdef, state)
        return run(model, x), nnx.state(model)

    x = np.ones((16, 3), np.float32)
    (n,) = jax.tree.leaves(jax.eval_shape(lambda *a: step(*a), state, x)[1]["n"])
    assert n.dtype == jnp.int32  # another function: another trace than the jit's
    assert int(jax.jit(step)(state, x)[1]["n"][...]) == 4
    assert len(made) == 2
    for carry, built in made:
        assert vars(carry).keys() == built.keys()
        assert all(vars(carry)[name] is value for name, value in built.items())


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_microbatched_refuses_module_state_of_another_type(change):
    """State the forward pass gives another dtype or shape cannot ride in
    the loop's carry: refused, naming the leaf, before the loop runs (not
    cast back, nor a loop's error)."""

    class Changing(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))
            self.c = nnx.BatchStat(jnp.zeros((1,), jnp.int32))

        def __call__(self, x):
            c = self.c[...]
            if change == "dtype":
                self.c.value = c + jnp.mean(x) + 0.25  # `[...] =` would cast
            else:
                self.c.value = jnp.concatenate([c, c])
            return x @ self.w[...]

    model = Changing()
    run = optax_ext.microbatched(lambda m, x: jnp.mean(m(x)), 4)
    with pytest.raises(ValueError, match=r"state at \[0\]\['c'\] from int32\[1\]"):
        run(model, np.ones((16, 3), np.float32))


def test_microbatched_refuses_module_state_changed_per_device():
    """Per device (`axis_name`, here inside `shard_map` over one device),
    each device would change the module's statistics its own way: refused,
    naming what changes, before anything runs."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, y = np.concatenate(XS[:2]), np.concatenate(YS[:2])

    def batch_loss(model, batch):
        return loss(model, *batch)

    def per_device(x, y):
        grad_fn = nnx.value_and_grad(batch_loss)
        run = optax_ext.microbatched(grad_fn, 2, axis_name="data")
        return run(NormDropModel(), (x, y))[0]

    spec = jax.sharding.PartitionSpec("data")
    step = jax.shard_map(
        per_device, mesh=mesh, in_specs=(spec, spec), out_specs=spec[1:]
    )
    with pytest.raises(ValueError, match="changes the state of an NNX module"):
        jax.jit(step)(x, y)


# --- checkpoints ---------------------------------------------------------------


def _save_and_restore(tmp_path, name, model, optimizer):
    """`nnx.state(model)` and `nnx.state(optimizer)` through orbax, restored
    into a fresh model (another init) and optimizer."""
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / name
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "model", nnx.state(model))
        checkpointer.save(path / "optimizer", nnx.state(optimizer))
    fresh = Model(seed=1)
    fresh_opt = nnx.Optimizer(fresh, optimizer.tx, wrt=nnx.Param)
    with ocp.StandardCheckpointer() as checkpointer:
        nnx.update(fresh, checkpointer.restore(path / "model", nnx.state(fresh)))
        nnx.update(
            fresh_opt, checkpointer.restore(path / "optimizer", nnx.state(fresh_opt))
        )
    return fresh, fresh_opt


def test_checkpoint_mid_window_restores_bit_exact_and_goes_on(tmp_path):
    """Saved mid-window (2 steps into the second window), restored bit for
    bit, and the rest of the run equal to an uninterrupted one: bit for bit
    for the fused step; within float32 rounding for a checkpoint of the
    drop-in `nnx.Optimizer.update` loop resumed with the fused step."""
    tx = optax_ext.MultiSteps(optax.adam(LR), K)
    whole, model, optimizer = run(tx, plain(fused_step))
    save_at = K + 2
    for step, name in [(fused_step, "fused"), (drop_in_step, "drop_in")]:
        first, m, o = run(tx, plain(step), steps=range(save_at))
        m2, o2 = _save_and_restore(tmp_path, name, m, o)
        assert int(o2.opt_state.mini_step[...]) == 2
        for a, b in zip(_leaves(nnx.state(m2)), _leaves(nnx.state(m)), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(_leaves(nnx.state(o2)), _leaves(nnx.state(o)), strict=True):
            np.testing.assert_array_equal(a, b)
        rest, m2, o2 = run(
            tx, plain(fused_step), range(save_at, K * WINDOWS), model=m2, optimizer=o2
        )
        assert int(o2.step[...]) == int(optimizer.step[...])
        for got, want in zip(first + rest, whole, strict=True):
            if step is fused_step:
                for a, b in zip(got, want, strict=True):
                    np.testing.assert_array_equal(a, b)
            else:
                assert_float32_close(got, want)
        if step is fused_step:  # the whole optimizer state too
            for a, b in zip(
                _leaves(nnx.state(o2)), _leaves(nnx.state(optimizer)), strict=True
            ):
                np.testing.assert_array_equal(a, b)
