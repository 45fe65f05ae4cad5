"""`stop_gradient_where`: a conditional `torch.no_grad()` for JAX values, a
selection between a value and its stopped copy (docs/gradient_context.md)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree


def _check_pred(pred: Any) -> jax.Array:
    pred = jnp.asarray(pred)
    if pred.dtype != jnp.bool_:
        raise TypeError(
            f"stop_gradient_where needs a bool predicate, got dtype {pred.dtype} "
            f"(shape {pred.shape}); compare first, e.g. `step < warmup`."
        )
    return pred


def _stop_leaf(pred: jax.Array, x: Any) -> Any:
    if not eqx.is_inexact_array(x):
        return x  # functions, integers, keys: no gradient to stop
    try:
        fits = jnp.broadcast_shapes(pred.shape, x.shape) == x.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"stop_gradient_where: a predicate of shape {pred.shape} does not "
            f"broadcast to a leaf of shape {x.shape}."
        )
    # A select, not `pred * x`: the value passes through bit for bit (NaN and
    # inf too) and the cotangent is selected, never multiplied by zero.
    return jnp.where(pred, lax.stop_gradient(x), x)


def stop_gradient_where(pred: Any, tree: PyTree) -> PyTree:
    """Blocks gradients through `tree` where `pred` is true; values unchanged.

    **Arguments:**

    - `pred`: a bool, or a bool array (traced is fine), or a pytree of them
      that is a prefix of `tree`: one predicate per subtree or per leaf. Each
      predicate may also be an array broadcastable against its leaves, to
      stop gradients element by element.
    - `tree`: any pytree. Leaves that are not floating arrays (an Equinox
      model's functions, integer buffers) are returned as they are.

    **Returns:**

    `tree` with the same values, dtypes and weak types, its gradient zero
    wherever `pred` is true and unchanged elsewhere.

    **Example:**

    ```python
    def loss(params, frozen):  # frozen: a traced bool
        encoder = optax_ext.stop_gradient_where(frozen, params["encoder"])
        return objective(encoder, params["head"])
    ```
    """
    if not jax.tree.leaves(pred):
        raise ValueError(
            f"stop_gradient_where: the predicate {pred!r} holds no bool; pass a "
            "bool, a bool array, or a pytree of them."
        )
    pred = jax.tree.map(_check_pred, pred)
    try:
        pred = jax.tree.broadcast(pred, tree)
    except ValueError as error:
        raise ValueError(
            "stop_gradient_where: the predicate tree must be a bool or a prefix of "
            f"the value tree ({jax.tree.structure(pred)} is not a prefix of "
            f"{jax.tree.structure(tree)})."
        ) from error
    return jax.tree.map(_stop_leaf, pred, tree)
