"""Train a padded-sequence Equinox model with token-weighted accumulation.

Sequences of 4 to 32 tokens are padded to 32; the loss of a micro-batch is
the mean over its non-padding tokens, as in any language-model trainer.
`MultiSteps(..., weighted=True)` takes each micro-batch's token count as
`weight=` and applies adamw to the gradient of the mean over all of the
window's tokens: what one step on the concatenated window would do.

Before training and at the end, the run measures on a few windows how far
each accumulated gradient (and the adamw update from it) is from the whole
window's, relative L2: the plain mean of the micro-batches' token means
(what `optax.MultiSteps` or `weighted=False` emit) against the weighted
mean. With `--bucketed` the micro-batches hold sequences of similar lengths
(length bucketing), so their token counts differ the most. It exits
non-zero if the loss does not fall or the weighted gap is not far below the
unweighted one. The whole window's gradient is computed in float32 (from bfloat16 params
with `--dtype bfloat16`, where bfloat16 arithmetic alone puts a few percent
between any bfloat16 gradient and it: the table's last row is one step on
the whole window in the params' dtype). The data is synthetic. From the repository root:

    python examples/weighted_tokens.py [--windows N] [--bucketed] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_ext

VOCAB, DIM, LENGTH = 32, 32, 32
ROWS, K = 8, 4  # sequences per micro-batch, micro-batches per window


class Decoder(eqx.Module):
    """Each position predicts the next token from the mean of its prefix's
    embeddings (a causal bag of tokens), through an MLP."""

    embed: eqx.nn.Embedding
    position: jax.Array
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array, dtype=jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1, dtype=dtype)
        self.position = (jax.random.normal(k2, (LENGTH, DIM)) * 0.1).astype(dtype)
        self.mlp = eqx.nn.MLP(DIM, VOCAB, 64, 2, key=k3, dtype=dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = jax.vmap(self.embed)(tokens) + self.position
        count = jnp.arange(1, LENGTH + 1, dtype=h.dtype)[:, None]
        return jax.vmap(self.mlp)(jnp.cumsum(h, axis=0) / count)


def token_mean_loss(model: Decoder, batch: dict) -> jax.Array:
    """Next-token cross-entropy, the mean over the non-padding targets."""
    logits = jax.vmap(model)(batch["tokens"])[:, :-1].astype(jnp.float32)
    targets = batch["tokens"][:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = batch["mask"][:, 1:]
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)


def tokens(batch: dict) -> jax.Array:
    """The micro-batch's weight: the targets its loss averages over."""
    return jnp.sum(batch["mask"][:, 1:])


def make_window(rng: np.random.Generator, bucketed: bool) -> list[dict]:
    """K micro-batches of ROWS sequences: each a walk `x + step (mod VOCAB)`
    with its own step, 4 to 32 tokens long, padded with 0 to LENGTH."""
    n = K * ROWS
    lengths = rng.integers(4, LENGTH + 1, size=n)
    if bucketed:
        lengths = np.sort(lengths)
    start = rng.integers(0, VOCAB, size=(n, 1))
    step = rng.integers(1, 4, size=(n, 1))
    seq = (start + step * np.arange(LENGTH)) % VOCAB
    mask = np.arange(LENGTH) < lengths[:, None]
    seq = np.where(mask, seq, 0)
    if bucketed:  # consecutive sequences of similar lengths
        parts = [slice(i * ROWS, (i + 1) * ROWS) for i in range(K)]
    else:  # every K-th sequence
        parts = [slice(i, None, K) for i in range(K)]
    return [
        {"tokens": jnp.asarray(seq[p]), "mask": jnp.asarray(mask[p])} for p in parts
    ]


def inner_optimizer() -> optax.GradientTransformation:
    return optax.chain(
        optax_ext.zero_nans(),
        optax_ext.inject_hyperparams(optax.adamw)(
            learning_rate=1e-2, weight_decay=0.01
        ),
    )


def make_step(opt):
    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, state):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        loss, grads = eqx.filter_value_and_grad(
            lambda p: token_mean_loss(eqx.combine(p, static), batch)
        )(params)
        params, state = optax_ext.apply_gradients(
            opt, grads, state, params, weight=tokens(batch)
        )
        return eqx.combine(params, static), state, loss

    return step


def _rel(a, b) -> float:
    a = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)]
    )
    b = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)]
    )
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_gaps(static):
    """`gaps(params, inner_state, window)`: the relative L2 distance to the
    whole window's gradient (computed in float32 whatever the params' dtype)
    and to adamw's update from it (from `inner_state`), of the gradients
    that MultiSteps emits without and with weights."""

    @jax.jit
    def grad(params, batch):
        return jax.grad(lambda p: token_mean_loss(eqx.combine(p, static), batch))(
            params
        )

    @jax.jit
    def grad32(params, batch):
        g = grad(jax.tree.map(lambda p: p.astype(jnp.float32), params), batch)
        return g, jax.tree.map(lambda g, p: g.astype(p.dtype), g, params)

    inner = inner_optimizer()
    inner_update = jax.jit(inner.update)
    accumulate = {}
    for weighted in (False, True):
        acc = optax_ext.MultiSteps(optax.sgd(-1.0), K, weighted=weighted)
        accumulate[weighted] = (acc, jax.jit(acc.update))

    def gaps(params, inner_state, window):
        big = {k: jnp.concatenate([b[k] for b in window]) for k in window[0]}
        want, rounded = grad32(params, big)
        want_u, _ = inner_update(rounded, inner_state, params)
        # The floor: one step on the whole window in the params' dtype.
        whole = grad(params, big)
        out = {"whole window gradient": _rel(whole, want)}
        out["whole window update"] = _rel(
            inner_update(whole, inner_state, params)[0], want_u
        )
        for weighted, (acc, update) in accumulate.items():
            state = acc.init(params)
            for b in window:
                kw = {"weight": tokens(b)} if weighted else {}
                emitted, state = update(grad(params, b), state, params, **kw)
            name = "weighted" if weighted else "unweighted"
            out[f"{name} gradient"] = _rel(emitted, want)
            got_u, _ = inner_update(emitted, inner_state, params)
            out[f"{name} update"] = _rel(got_u, want_u)
        return out

    return gaps


def train(windows: int, bucketed: bool, dtype=jnp.float32, seed: int = 0):
    """Trains for `windows` windows of K micro-batches; returns the losses
    (each window's loss over all its tokens) and the gaps measured on
    the first and last 3 windows."""
    rng = np.random.default_rng(seed)
    model = Decoder(jax.random.key(seed), dtype)
    opt = optax_ext.MultiSteps(inner_optimizer(), K, weighted=True)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(opt)
    data = [make_window(rng, bucketed) for _ in range(windows)]
    gaps = make_gaps(eqx.partition(model, eqx.is_inexact_array)[1])
    measured = []
    losses = []
    for w, window in enumerate(data):
        if w < 3 or w >= windows - 3:
            params = eqx.filter(model, eqx.is_inexact_array)
            measured.append(gaps(params, state.inner_opt_state, window))
        # The window's loss: its token-weighted mean, as the gradient is.
        loss_sum, token_sum = 0.0, 0.0
        for batch in window:
            model, state, loss = step(batch, model, state)
            n = float(tokens(batch))
            loss_sum, token_sum = loss_sum + float(loss) * n, token_sum + n
        losses.append(loss_sum / max(token_sum, 1.0))
    mean_gaps = {k: float(np.mean([m[k] for m in measured])) for k in measured[0]}
    return losses, mean_gaps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--bucketed", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    losses, gap = train(args.windows, args.bucketed, jnp.dtype(args.dtype))
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("relative L2 distance to the whole window's float32 gradient and adamw's")
    print("update from it (mean over 6 windows):")
    print("| computed as | gradient | adamw update |")
    print("|---|---|---|")
    for name in ("unweighted", "weighted", "whole window"):
        print(
            f"| {name} | {gap[f'{name} gradient']:.2e} | {gap[f'{name} update']:.2e} |"
        )
    if not losses[-1] < 0.8 * losses[0]:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    # float32: only rounding is left; bfloat16: its arithmetic alone puts
    # the micro-batches' gradients a few percent from the float32 one.
    factor = 0.01 if args.dtype == "float32" else 0.5
    if not gap["weighted gradient"] < factor * gap["unweighted gradient"]:
        print(
            "FAILED: the weighted gap is not far below the unweighted", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
