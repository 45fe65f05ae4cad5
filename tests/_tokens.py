"""A small padded-sequence model for the weighted-accumulation tests: the
gradient of a micro-batch's token-mean loss, and of the whole (concatenated)
batch's, computed directly in float64 and rounded once to float32.
Independent of optax_ext."""

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, DIM, ROWS, LENGTH = 11, 6, 4, 8


def params32():
    rng = np.random.default_rng(0)
    return {
        "embed": jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32),
        "out": jnp.asarray(rng.normal(size=(DIM, VOCAB)) * 0.5, jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(VOCAB,)) * 0.1, jnp.float32),
    }


def micro_batch(seed, tokens, rows=ROWS):
    """`rows` sequences of random lengths padded to LENGTH, holding `tokens`
    non-padding tokens in all (0 gives an all-padding micro-batch)."""
    assert 0 <= tokens <= rows * LENGTH
    rng = np.random.default_rng(seed)
    lengths = np.zeros(rows, int)
    for _ in range(tokens):  # spread at random over rows with room left
        room = np.flatnonzero(lengths < LENGTH)
        lengths[rng.choice(room)] += 1
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = rng.integers(0, VOCAB, size=(rows, LENGTH))
    y = rng.integers(0, VOCAB, size=(rows, LENGTH))
    return {"x": x, "y": y, "mask": mask}


def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def token_mean_loss(params, batch):
    """The mean over the batch's non-padding tokens of the next-token
    cross-entropy: sum / count, NaN for an all-padding batch (0 / 0), as a
    plain trainer computes it."""
    h = jnp.tanh(params["embed"][batch["x"]])
    logits = h @ params["out"] + params["bias"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
    mask = batch["mask"].astype(nll.dtype)
    return jnp.sum(nll * mask) / jnp.sum(mask)


def token_sum_loss(params, batch):
    """The sum over the batch's non-padding tokens of the cross-entropy."""
    return token_mean_loss(params, batch) * jnp.sum(batch["mask"])


def _grad64(params, batch, loss):
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    return jax.grad(loss)(params, batch)


_jitted_grad64 = jax.jit(_grad64, static_argnums=2)


def grad(params, batch, loss=token_mean_loss):
    """The token-mean gradient (or `loss`'s), computed in float64 and
    rounded to float32."""
    with jax.enable_x64(True):
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        g = _jitted_grad64(params, batch, loss)
        return jax.tree.map(lambda v: np.asarray(v, np.float32), g)


def sum_grad(params, batch):
    """The gradient of the token-summed loss, in float64, rounded to float32;
    zeros for an all-padding batch."""
    if tokens(batch) == 0:
        return jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
    return grad(params, batch, token_sum_loss)


def tokens(batch):
    return int(np.sum(batch["mask"]))
