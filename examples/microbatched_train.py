"""Train an Equinox MLP with dropout, accumulating gradients inside the step.

`optax_ext.microbatched` wraps `eqx.filter_value_and_grad(loss)`: the jitted
train step loops over `k` micro-batches of its batch (one `lax.fori_loop`),
splits the dropout key per micro-batch, and returns the whole batch's loss and
gradients; one adam step follows. The loss, the learning-rate schedule and
the step count are per global batch, as without accumulation.

The run prints the compiled step's temporary memory with and without
micro-batching (`memory_analysis()` of the compiled step) and exits non-zero
if the final loss is not well below the first one. The data is synthetic,
made with `jax.random`. From the repository root:

    python examples/microbatched_train.py [--steps N] [--microbatches K]
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import optax_ext

IN_SIZE, WIDTH, DEPTH = 32, 512, 3
BATCH = 2048


class Net(eqx.Module):
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __init__(self, key: jax.Array):
        self.mlp = eqx.nn.MLP(IN_SIZE, 1, WIDTH, DEPTH, key=key)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        h = x
        keys = jax.random.split(key, len(self.mlp.layers))
        for layer, k in zip(self.mlp.layers[:-1], keys[:-1], strict=True):
            h = self.dropout(jax.nn.gelu(layer(h)), key=k)
        return self.mlp.layers[-1](h)[0]


def loss(model: Net, batch: tuple, key: jax.Array) -> jax.Array:
    """Mean over the batch's rows (`microbatched` averages micro-batches)."""
    x, y = batch
    keys = jax.random.split(key, x.shape[0])
    pred = jax.vmap(model)(x, keys)
    return jnp.mean((pred - y) ** 2)


def make_data(key: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """A smooth target of random inputs: `steps` batches of BATCH rows."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (steps, BATCH, IN_SIZE))
    w = jax.random.normal(kw, (IN_SIZE,)) / jnp.sqrt(IN_SIZE)
    return x, jnp.tanh(x @ w)


def make_step(optimizer: optax.GradientTransformation, microbatches: int):
    grad_fn = eqx.filter_value_and_grad(loss)
    if microbatches > 1:
        grad_fn = optax_ext.microbatched(grad_fn, microbatches, key_argnum=2)

    @eqx.filter_jit
    def step(model, opt_state, batch, key):
        value, grads = grad_fn(model, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def temp_bytes(step, *args) -> int:
    """Temporary memory of the compiled step (its activations, mostly)."""
    compiled = step.lower(*args).compile().compiled  # eqx.filter_jit's wrapper
    return compiled.memory_analysis().temp_size_in_bytes


def train(steps: int, microbatches: int, seed: int = 0, progress: bool = True):
    """Trains for `steps` global batches; returns the losses and the model,
    and the step's compiled temporary memory with and without micro-batching."""
    k_model, k_data, k_drop = jax.random.split(jax.random.key(seed), 3)
    model = Net(k_model)
    xs, ys = make_data(k_data, steps)
    schedule = optax.cosine_decay_schedule(3e-3, steps)  # in global batches
    optimizer = optax.adam(schedule)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = make_step(optimizer, microbatches)
    args = (model, opt_state, (xs[0], ys[0]), k_drop)
    memory = {
        "full batch": temp_bytes(make_step(optimizer, 1), *args),
        f"{microbatches} micro-batches": temp_bytes(step, *args),
    }
    losses = []
    bar = tqdm(range(steps), disable=not progress, desc="train")
    for t in bar:
        model, opt_state, value = step(
            model, opt_state, (xs[t], ys[t]), jax.random.fold_in(k_drop, t)
        )
        losses.append(float(value))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses, model, memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    losses, _, memory = train(args.steps, args.microbatches, args.seed)
    (full, full_bytes), (micro, micro_bytes) = memory.items()
    print(f"compiled temp memory, {full}: {full_bytes / 2**20:.1f} MiB")
    print(
        f"compiled temp memory, {micro}: {micro_bytes / 2**20:.1f} MiB "
        f"({1 - micro_bytes / full_bytes:.0%} saved)"
    )
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        print("FAILED: the loss did not fall by half", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
