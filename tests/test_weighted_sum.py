"""A token-weighted sum: `MultiSteps(weighted=True, use_grad_mean=False)`
and `microbatched(..., weight_fn=..., use_grad_mean=False)` give
sum_i w_i g_i, the gradient of the token-summed loss of the window's (or
the batch's) tokens when g_i is micro-batch i's token-mean gradient and w_i
its token count; `microbatched(..., use_grad_mean=False)` without weights
sums the micro-batches' outputs.

The references are independent of optax_ext: the gradient of the
token-summed loss of the concatenated window computed directly in float64
and rounded once to float32 (`_tokens.py`), and plain optax applied to it,
jitted as the accumulating step is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tokens import (
    LENGTH,
    concat,
    grad,
    micro_batch,
    params32,
    sum_grad,
    token_mean_loss,
    token_sum_loss,
    tokens,
)

import optax_ext

K = 4
# Uneven token counts (of 32 places), an all-padding micro-batch (its
# token-mean gradient is NaN: 0 / 0, and is not read), and a window without
# a token, which applies nothing.
WINDOWS = [[5, 17, 32, 9], [0, 12, 3, 30], [0, 0, 0, 0], [20, 0, 0, 1]]
INNERS = {"sgd": lambda: optax.sgd(1e-2), "adam": lambda: optax.adam(1e-2)}


def _batches(windows):
    return [
        [micro_batch(100 * w + i, n) for i, n in enumerate(window)]
        for w, window in enumerate(windows)
    ]


def _assert_close(got, want, rtol=2e-6):
    """float32 against float32 rounded from float64: `rtol` elementwise,
    with a floor of `rtol` times the leaf's largest entry (an entry near 0
    is a difference of larger terms)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        atol = rtol * float(np.max(np.abs(w), initial=0.0))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _reference(make_inner, params, windows):
    """Plain optax on each window's token-summed gradient; a window
    without a token applies nothing. The params after each window."""
    inner = make_inner()
    state = inner.init(params)
    update = jax.jit(inner.update)
    out = []
    for window in windows:
        batch = concat(window)
        if tokens(batch):
            updates, state = update(sum_grad(params, batch), state, params)
            params = optax.apply_updates(params, updates)
        out.append(params)
    return out


def _step(opt, form):
    if form == "update":

        def step(grads, state, params, weight, last):
            updates, state = opt.update(grads, state, params, weight=weight)
            return optax.apply_updates(params, updates), state

        return jax.jit(step, static_argnums=4)
    emit = form == "emit="

    def fused(grads, state, params, weight, last):
        return optax_ext.apply_gradients(
            opt, grads, state, params, weight=weight, emit=last if emit else None
        )

    return jax.jit(fused, static_argnums=4)


def _run(opt, params, windows, form):
    step = _step(opt, form)
    state = opt.init(params)
    out = []
    for window in windows:
        for i, batch in enumerate(window):
            g = grad(params, batch)
            params, state = step(g, state, params, tokens(batch), i == K - 1)
        out.append(params)
    return out, state


@pytest.mark.parametrize("form", ["update", "apply_gradients", "emit="])
@pytest.mark.parametrize("inner", INNERS)
def test_window_applies_the_inner_optimizer_to_the_token_summed_gradient(
    inner, form, window_form
):
    params, windows = params32(), _batches(WINDOWS)
    opt = optax_ext.MultiSteps(INNERS[inner](), K, weighted=True, use_grad_mean=False)
    got, state = _run(window_form(opt), params, windows, form)
    for g, w in zip(got, _reference(INNERS[inner], params, windows), strict=True):
        _assert_close(g, w)
    # The window without a token was not applied, nor counted.
    assert int(state.gradient_step) == len(WINDOWS) - 1
    assert float(state.acc_weight) == 0.0 and int(state.mini_step) == 0


def test_weighted_sum_is_not_the_weighted_mean():
    """The discrimination: the two accumulations differ by the window's
    token count, so a test of one cannot pass on the other."""
    params, (window, *_) = params32(), _batches(WINDOWS)
    updates = {}
    for mean in (True, False):
        opt = optax_ext.MultiSteps(optax.sgd(1.0), K, weighted=True, use_grad_mean=mean)
        state = opt.init(params)
        for batch in window:
            u, state = opt.update(grad(params, batch), state, weight=tokens(batch))
        updates[mean] = u
    n = tokens(concat(window))
    _assert_close(
        jax.tree.map(lambda u: -u, updates[False]), sum_grad(params, concat(window))
    )
    _assert_close(jax.tree.map(lambda u: u * n, updates[True]), updates[False], 1e-5)


def test_skipped_mini_step_adds_neither_gradient_nor_weight():
    """`optax.skip_not_finite` skips a mini-step with an infinite gradient:
    the window's sum is the other micro-batches' token-summed gradient."""
    params = params32()
    batches = [micro_batch(i, n) for i, n in enumerate([7, 12, 25])]
    bad = jax.tree.map(lambda g: np.full_like(g, np.inf), grad(params, batches[0]))
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0),
        2,
        should_skip_update_fn=optax.skip_not_finite,
        weighted=True,
        use_grad_mean=False,
    )
    step = jax.jit(lambda g, s, w: opt.update(g, s, params, weight=w))
    state = opt.init(params)
    _, state = step(grad(params, batches[0]), state, tokens(batches[0]))
    _, state = step(bad, state, 30)
    updates, state = step(grad(params, batches[2]), state, tokens(batches[2]))
    want = sum_grad(params, concat([batches[0], batches[2]]))
    _assert_close(jax.tree.map(lambda u: -u, updates), want)
    assert int(state.gradient_step) == 1


def _batch(counts, rows=4, seed=0):
    """The batch whose micro-batch j (rows j, j + K, ...) holds counts[j]
    tokens."""
    parts = [micro_batch(seed + j, n, rows=rows) for j, n in enumerate(counts)]
    return {
        k: np.stack([p[k] for p in parts], axis=1).reshape(-1, LENGTH) for k in parts[0]
    }


def _tokens_of(params, batch):
    del params
    return jnp.sum(batch["mask"])


def _whole64(fn, params, batch):
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        out = jax.jit(fn)(p64, {k: jnp.asarray(v) for k, v in batch.items()})
        return jax.tree.map(lambda v: np.asarray(v, np.float32), out)


@pytest.mark.parametrize("counts", [[3, 27, 0, 11], [0, 0, 0, 0]])
def test_microbatched_weighted_sum_is_the_token_summed_loss_and_gradient(counts):
    params, batch = params32(), _batch(counts)
    fn = optax_ext.microbatched(
        jax.value_and_grad(token_mean_loss),
        K,
        weight_fn=_tokens_of,
        use_grad_mean=False,
    )
    got = jax.jit(fn)(params, batch)
    if sum(counts) == 0:
        for leaf in jax.tree.leaves(got):
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
        return
    _assert_close(got, _whole64(jax.value_and_grad(token_sum_loss), params, batch))


def test_microbatched_sum_adds_the_micro_batches_outputs():
    """Without weights, `use_grad_mean=False` sums each micro-batch's loss
    and gradient: the float64 sum over the micro-batches computed apart."""
    params, batch = params32(), _batch([9, 14, 30, 2])
    fn = jax.value_and_grad(token_mean_loss)
    got = jax.jit(optax_ext.microbatched(fn, K, use_grad_mean=False))(params, batch)
    parts = [
        _whole64(fn, params, {k: v[j::K] for k, v in batch.items()}) for j in range(K)
    ]
    with jax.enable_x64(True):
        want = jax.tree.map(
            lambda *xs: np.asarray(
                np.sum(np.stack(xs).astype(np.float64), 0), np.float32
            ),
            *parts,
        )
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_microbatched_sum_scales_gradient_rows_as_the_summed_loss(weighted):
    """`per_example="gradient"`: each micro-batch's rows of a gradient with
    respect to the batch, as of the summed (or weighted-summed) loss of
    the micro-batches: the float64 gradient of that loss computed whole."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    weights = np.array([2.0, 0.0, 5.0, 1.0], np.float32)

    def loss(x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    index = jnp.arange(8, dtype=jnp.float32)[:, None] % K  # micro-batch of a row
    xi = jnp.concatenate([x, index], axis=1)

    def grad_fn(xi):
        return jax.grad(lambda xi: loss(xi[:, :3]))(xi)

    def weight_of(xi):
        return jnp.asarray(weights)[xi[0, 3].astype(jnp.int32)]

    fn = optax_ext.microbatched(
        grad_fn,
        K,
        batch_argnums=0,
        weight_fn=weight_of if weighted else None,
        per_example="gradient",
        use_grad_mean=False,
    )
    got = np.asarray(jax.jit(fn)(xi))[:, :3]

    def whole(x64):
        total = 0.0
        for j in range(K):
            scale = weights[j] if weighted else 1.0
            total = total + scale * jnp.mean(
                jnp.tanh(x64[j::K] @ w.astype(x64.dtype)) ** 2
            )
        return total

    with jax.enable_x64(True):
        want = np.asarray(jax.grad(whole)(x.astype(jnp.float64)), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
