"""Flax Linen: `MultiSteps` through the stock `TrainState.apply_gradients`,
the fused step `train_state_apply_gradients` (weighted mean, weighted sum,
`emit=`, any optax optimizer, subclasses and fp8 params), `microbatched`
inside a TrainState step, an orbax checkpoint of the TrainState, and the
errors that point a Linen user to the helper.

The references are independent of optax_ext: `optax.MultiSteps` through the
stock `TrainState.apply_gradients`, plain optax applied to the gradient of
each window's whole batch (its token mean, or its token sum), `jax.grad` on
the whole batch, and an uninterrupted run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_float32_close, assert_same_arithmetic

import optax_ext

nn = pytest.importorskip("flax.linen")
train_state = pytest.importorskip("flax.training.train_state")
TrainState = train_state.TrainState

K, WINDOWS, LR, ROWS = 3, 3, 0.05, 8
EPS = float(np.finfo(np.float32).eps)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))[..., 0]


MODEL = MLP()
PARAMS = MODEL.init(jax.random.key(0), jnp.ones((1, 3)))["params"]


def token_loss(params, x, y, mask):
    """The mean over the mini-batch's tokens (rows whose mask is 1)."""
    err = (MODEL.apply({"params": params}, x) - y) ** 2
    return jnp.sum(mask * err) / jnp.maximum(jnp.sum(mask), 1.0)


def _data():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(K * WINDOWS, ROWS, 3)).astype(np.float32)
    ys = rng.normal(size=(K * WINDOWS, ROWS)).astype(np.float32)
    # Padded mini-batches: uneven token counts, one mini-batch all padding.
    tokens = [8, 3, 0, 5, 8, 2, 6, 1, 4]
    masks = np.array([[1.0] * n + [0.0] * (ROWS - n) for n in tokens], np.float32)
    return xs, ys, masks, np.ones_like(masks)


XS, YS, MASKS, FULL = _data()


def create(tx, cls=TrainState, **fields):
    return cls.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx, **fields)


@jax.jit
def stock_step(state, x, y, mask):
    return state.apply_gradients(grads=jax.grad(token_loss)(state.params, x, y, mask))


@functools.partial(jax.jit, static_argnames="emit")
def fused_step(state, x, y, mask, emit=None, **extra):
    grads = jax.grad(token_loss)(state.params, x, y, mask)
    return optax_ext.train_state_apply_gradients(state, grads, emit=emit, **extra)


def leaves(tree):
    """A copy of the leaves of `tree` as NumPy arrays."""
    return [np.array(x) for x in jax.tree.leaves(tree)]


def run(state, step, steps=range(K * WINDOWS), masks=FULL, **options):
    """The params after each window's last step, and the last state.
    `options`: `weight=True` passes each step's token count as `weight=`,
    `emit=True` ends each window on the host."""
    after_windows = []
    for t in steps:
        extra = {}
        if options.get("weight"):
            extra["weight"] = jnp.float32(masks[t].sum())
        if options.get("emit"):
            extra["emit"] = t % K == K - 1
        state = step(state, XS[t], YS[t], masks[t], **extra)
        if t % K == K - 1:
            after_windows.append(leaves(state.params))
    return after_windows, state


def assert_moved(windows):
    """Every window changed the params: a reference that did nothing would
    compare equal to a run that did nothing."""
    before = leaves(PARAMS)
    for params in windows:
        pairs = zip(params, before, strict=True)
        assert any(not np.array_equal(a, b) for a, b in pairs)
        before = params


@functools.partial(jax.jit, static_argnames="summed")
def whole_batch_grad(params, x, y, mask, summed):
    """The gradient of the whole window's batch: its token sum, or mean."""

    def whole(params):
        total = jnp.sum(mask * (MODEL.apply({"params": params}, x) - y) ** 2)
        return total if summed else total / jnp.sum(mask)

    return jax.grad(whole)(params)


def big_batch_reference(inner, summed):
    """`inner` (plain optax) on the gradient of each window's whole batch,
    its mini-batches concatenated: no accumulation, no TrainState."""
    params, out = PARAMS, []
    state = inner.init(params)
    for w in range(WINDOWS):
        window = slice(w * K, (w + 1) * K)
        x, y, m = (np.concatenate(a[window]) for a in (XS, YS, MASKS))
        grads = whole_batch_grad(params, x, y, m, summed)
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(leaves(params))
    return out


ADAM_WINDOWS = optax_ext.MultiSteps(optax.adam(LR), K)  # one compile per step


# --- the drop-in and the fused step --------------------------------------------


def test_drop_in_and_fused_step_equal_optax_multisteps_through_train_state():
    """`optax_ext.MultiSteps` in place of `optax.MultiSteps` in a stock
    `TrainState` (through `TrainState.apply_gradients`), and the fused
    `train_state_apply_gradients`: the params after each window equal
    `optax.MultiSteps`' bit for bit at XLA:CPU -O0, where the programs do
    the same float32 operations; elsewhere within 4 float32 roundings of
    the params' scale (the programs compile the inner step apart: adam's
    update is `lr * m / (sqrt(v) + eps)`, a few roundings from the same
    mean gradient). The fused step leaves the params as they are on a
    mini-step; the counters and the state's structure are the stock ones,
    so a checkpoint of one loads in the other."""
    want, ref = run(create(optax.MultiSteps(optax.adam(LR), K)), stock_step)
    drop_in, drop_in_state = run(create(ADAM_WINDOWS), stock_step)
    state, fused = create(ADAM_WINDOWS), []
    for t in range(K * WINDOWS):
        before = leaves(state.params)
        state = fused_step(state, XS[t], YS[t], FULL[t])
        if t % K != K - 1:
            for a, b in zip(leaves(state.params), before, strict=True):
                np.testing.assert_array_equal(a, b)
        else:
            fused.append(leaves(state.params))
    assert_moved(want)
    for w, d, f in zip(want, drop_in, fused, strict=True):
        assert_same_arithmetic(d, w)
        assert_same_arithmetic(f, w)
    assert int(state.step) == int(drop_in_state.step) == int(ref.step) == K * WINDOWS
    assert int(state.opt_state.gradient_step) == int(ref.opt_state.gradient_step)
    assert jax.tree.structure(state) == jax.tree.structure(drop_in_state)


def test_any_optax_optimizer_and_subclass_fields_and_fp8_params():
    """A plain optax optimizer (adam) through the helper equals
    `TrainState.apply_gradients`; a subclass keeps its type and extra
    fields; fp8 params (`OVERWRITE_WITH_GRADIENT`) are stepped as flax
    steps them: the optimizer on `params["params"]`, the rest replaced by
    its gradient."""

    class WithStats(TrainState):
        batch_stats: dict

    stats = {"mean": jnp.arange(3.0)}
    state = create(optax.adam(LR), WithStats, batch_stats=stats)
    grads = jax.grad(token_loss)(state.params, XS[0], YS[0], FULL[0])
    got = jax.jit(optax_ext.train_state_apply_gradients)(state, grads)
    want = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert type(got) is WithStats
    np.testing.assert_array_equal(got.batch_stats["mean"], stats["mean"])
    assert int(got.step) == int(want.step) == 1
    assert_moved([leaves(got.params)])
    assert_same_arithmetic(leaves(got.params), leaves(want.params))
    assert_same_arithmetic(leaves(got.opt_state), leaves(want.opt_state))

    key = nn.fp8_ops.OVERWRITE_WITH_GRADIENT
    fp8_params = {"params": PARAMS, key: {"scale": jnp.ones(2)}}
    fp8_grads = {"params": grads, key: {"scale": jnp.full(2, 3.0)}}
    state = TrainState.create(apply_fn=None, params=fp8_params, tx=optax.sgd(LR))
    got = optax_ext.train_state_apply_gradients(state, fp8_grads)
    want = state.apply_gradients(grads=fp8_grads)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.params[key]["scale"], [3.0, 3.0])


# --- weighted windows and emit= against the whole batch ----------------------------


@pytest.mark.parametrize("summed", [False, True], ids=["mean", "sum"])
def test_weighted_window_equals_plain_optax_on_the_whole_batch(summed):
    """`MultiSteps(sgd, weighted=True)` with each padded mini-batch's token
    count as `weight=` (uneven, one mini-batch all padding: weight 0),
    through `train_state_apply_gradients`: after each window, the params of
    plain sgd on the gradient of the window's whole batch (its 24 rows at
    once): its token mean, and with `use_grad_mean=False` its token sum.
    The same with the windows ended by `emit=` on the host, the state's own
    window never ending (`every_k_schedule` 2**30): ignoring `emit` would
    leave the params as they are.

    The two sum the same float32 terms in another order (a weighted running
    mean or sum over 3 mini-steps, against one reduction over 24 rows): the
    gradients differ by a few roundings of their scale, which `lr` makes far
    less than a rounding of the params. So the params differ by the rounding
    of `params - lr * grads`, at most one per window: 3 float32 roundings of
    their scale after 3 windows, 4 as the bound (measured: under one)."""
    lr = LR / 30 if summed else LR  # the token sum is ~30 times the mean
    want = big_batch_reference(optax.sgd(lr), summed)
    assert_moved(want)
    for k, emit in [(K, False), (2**30, True)]:
        inner = optax.sgd(lr)
        tx = optax_ext.MultiSteps(inner, k, weighted=True, use_grad_mean=not summed)
        got, state = run(create(tx), fused_step, masks=MASKS, weight=True, emit=emit)
        for g, w in zip(got, want, strict=True):
            assert_float32_close(g, w)
        assert int(state.opt_state.gradient_step) == WINDOWS


def test_stock_apply_gradients_drops_weight_and_the_error_names_the_helper():
    """`TrainState.apply_gradients(grads=g, weight=n)` runs `tx.update`
    without the weight (it sends its keywords to `.replace`): the weighted
    `MultiSteps` says so, naming TrainState and the helpers."""
    tx = optax_ext.MultiSteps(optax.sgd(LR), K, weighted=True)
    state = create(tx)
    grads = jax.grad(token_loss)(state.params, XS[0], YS[0], MASKS[0])
    with pytest.raises(
        TypeError,
        match=r"needs `weight=`.*TrainState\.apply_gradients.*"
        r"optax_ext\.train_state_apply_gradients\(state, grads, weight=n\).*"
        r"optax_ext\.nnx_apply_gradients",
    ):
        state.apply_gradients(grads=grads, weight=jnp.float32(8.0))
    new = optax_ext.train_state_apply_gradients(state, grads, weight=8.0)
    assert float(new.opt_state.acc_weight) == 8.0


# --- microbatched inside a TrainState step --------------------------------------


def test_microbatched_inside_a_stock_train_state_step():
    """`microbatched(jax.value_and_grad(loss), 4)` on the params inside a
    stock TrainState step: the whole batch's loss and gradient
    (`jax.value_and_grad` on the 16 rows at once, jitted) within 16 float32
    roundings of their scale (the 4 micro-batches' means, then their mean,
    against one mean over 16 rows), and the step's params within 4 of
    adam's on that gradient."""
    x, y = np.concatenate(XS[:2]), np.concatenate(YS[:2])
    mask = np.ones(2 * ROWS, np.float32)
    grad_fn = jax.value_and_grad(token_loss)

    @jax.jit
    def micro_step(state, x, y, mask):
        micro = optax_ext.microbatched(grad_fn, 4, batch_argnums=(1, 2, 3))
        loss, grads = micro(state.params, x, y, mask)
        return loss, grads, state.apply_gradients(grads=grads)

    @jax.jit
    def whole_step(state, x, y, mask):
        loss, grads = grad_fn(state.params, x, y, mask)
        return loss, grads, state.apply_gradients(grads=grads)

    got_loss, got, got_state = micro_step(create(optax.adam(LR)), x, y, mask)
    want_loss, want, want_state = whole_step(create(optax.adam(LR)), x, y, mask)
    np.testing.assert_allclose(got_loss, want_loss, rtol=8 * EPS)
    assert_float32_close(leaves(got), leaves(want), ulps=16)
    assert_moved([leaves(got_state.params)])
    assert_float32_close(leaves(got_state.params), leaves(want_state.params))


# --- an orbax checkpoint mid-window ---------------------------------------------


def test_orbax_checkpoint_mid_window_restores_bit_exact_and_goes_on(tmp_path):
    """The TrainState saved 2 mini-steps into the second window with orbax
    and restored into a fresh `TrainState.create` (other params): bit for
    bit the saved state, and the rest of the run bit for bit the
    uninterrupted one (one program, the same inputs), state included."""
    ocp = pytest.importorskip("orbax.checkpoint")
    whole, final = run(create(ADAM_WINDOWS), fused_step)
    save_at = K + 2
    first, saved = run(create(ADAM_WINDOWS), fused_step, steps=range(save_at))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", saved)
    fresh = create(ADAM_WINDOWS).replace(params=jax.tree.map(jnp.zeros_like, PARAMS))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "state", fresh)
    assert type(restored) is TrainState and restored.tx is ADAM_WINDOWS
    assert int(restored.opt_state.mini_step) == 2
    for a, b in zip(leaves(restored), leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    rest, state = run(restored, fused_step, steps=range(save_at, K * WINDOWS))
    for got, want in zip(first + rest, whole, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(state), leaves(final), strict=True):
        np.testing.assert_array_equal(a, b)


# --- argument errors -------------------------------------------------------------


def test_bad_arguments_raise_naming_what_was_passed():
    class WithStats(TrainState):
        batch_stats: dict

    state = create(optax.adam(LR), WithStats, batch_stats={})
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    helper = optax_ext.train_state_apply_gradients
    with pytest.raises(
        TypeError, match=r"state must be a flax `TrainState`.* got dict: \{'params'"
    ):
        helper({"params": PARAMS}, grads)
    with pytest.raises(
        TypeError, match=r"emit=True .*state\.tx must be an optax_ext\.MultiSteps"
    ):
        helper(state, grads, emit=True)
    with pytest.raises(
        TypeError,
        match=r"batch_stats= names a field of the TrainState.*"
        r"\.replace\(batch_stats=\.\.\.\)",
    ):
        helper(state, grads, batch_stats={"mean": 1.0})
    with pytest.raises(TypeError, match=r"emit must be a bool known on the host"):
        helper(create(ADAM_WINDOWS), grads, emit=jnp.asarray(True))
    # grads by keyword, as `state.apply_gradients(grads=...)` takes them.
    assert int(helper(state, grads=grads).step) == 1
