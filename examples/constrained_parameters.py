"""Constrained parameters: apply the constraint at call time, train the raw value.

The PyTorch pitfall this answers: a sigmoid-constrained parameter computed
once in `__init__` (`self.p = torch.sigmoid(self.raw)`) is a separate tensor;
the optimizer then moves `p` itself, the constraint breaks, and `raw` gets no
gradient. Computing `sigmoid(raw)` in `forward` is right.

In Equinox the same rule holds: keep the unconstrained array as the leaf and
apply the map when the model is called. `paramax.Parameterize(fn, raw)`
packages exactly that (and `paramax.unwrap` applies every such map), so this
example uses it rather than a helper of our own. The model is trained with
the package's transformations: `MultiSteps` over `zero_nans` and an
injected AdamW whose weight-decay mask is itself an Equinox model of bools,
deciding per leaf (decay the weight matrix, not the raw constrained values).

    python examples/constrained_parameters.py
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import paramax

import optax_ext


class Gated(eqx.Module):
    """y = scale * (p * tanh(W x) + (1 - p) * x), with p in (0, 1), scale > 0."""

    weight: jax.Array
    p: paramax.Parameterize  # sigmoid(raw): in (0, 1) at every step
    scale: paramax.Parameterize  # softplus(raw): positive at every step

    def __init__(self, size: int, key: jax.Array):
        self.weight = jax.random.normal(key, (size, size)) / jnp.sqrt(size)
        self.p = paramax.Parameterize(jax.nn.sigmoid, jnp.zeros(()))
        self.scale = paramax.Parameterize(jax.nn.softplus, jnp.zeros(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        model = paramax.unwrap(self)  # the constraints, applied at call time
        mix = model.p * jnp.tanh(model.weight @ x) + (1 - model.p) * x
        return model.scale * mix


def decay_mask(model: Gated) -> Gated:
    """An Equinox model of bools: weight decay on the weight matrix only."""
    mask = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.weight, mask, True)


def make_optimizer(model: Gated, every_k: int = 2) -> optax_ext.MultiSteps:
    return optax_ext.MultiSteps(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.adamw)(
                learning_rate=optax.cosine_decay_schedule(0.05, 400),
                weight_decay=1e-3,
                mask=decay_mask(model),  # a callable pytree: no static_args
            ),
        ),
        every_k_schedule=every_k,
    )


def loss(model: Gated, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train(model: Gated, x: jax.Array, y: jax.Array, steps: int):
    opt = make_optimizer(model)
    state = opt.init(model)

    @eqx.filter_jit
    def step(model, state, xb, yb):
        value, grads = eqx.filter_value_and_grad(loss)(model, xb, yb)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    history = []
    for i in range(steps):
        batch = slice((i * 32) % x.shape[0], (i * 32) % x.shape[0] + 32)
        model, state, value = step(model, state, x[batch], y[batch])
        unwrapped = paramax.unwrap(model)
        history.append((float(value), float(unwrapped.p), float(unwrapped.scale)))
    return model, history


def synthetic_data(key: jax.Array, size: int = 4, n: int = 512):
    k_model, k_x = jax.random.split(key)
    truth = Gated(size, k_model)
    truth = eqx.tree_at(
        lambda m: (m.p.args[0], m.scale.args[0]),
        truth,
        (jnp.asarray(1.4), jnp.asarray(2.3)),  # p = 0.80, scale = 2.40
    )
    x = jax.random.normal(k_x, (n, size))
    return truth, x, jax.vmap(truth)(x)


def main() -> None:
    truth, x, y = synthetic_data(jax.random.key(0))
    model = Gated(4, jax.random.key(1))
    model, history = train(model, x, y, steps=400)
    true = paramax.unwrap(truth)
    print(f"loss {history[0][0]:.4f} -> {history[-1][0]:.4f}")
    p_ok = all(0 < h[1] < 1 for h in history)
    scale_ok = all(h[2] > 0 for h in history)
    print(f"p: 0.500 -> {history[-1][1]:.3f} (true {float(true.p):.3f}), ", end="")
    print(f"in (0, 1) at every step: {p_ok}")
    print(f"scale: {history[0][2]:.3f} -> {history[-1][2]:.3f} ", end="")
    print(f"(true {float(true.scale):.3f}), positive at every step: {scale_ok}")


if __name__ == "__main__":
    main()
