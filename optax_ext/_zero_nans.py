"""`zero_nans`: replace NaN in updates with zero, keeping every dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ._tree import trainable


def _found_nan(update: jax.Array) -> jax.Array:
    update = jnp.asarray(update)
    if not jnp.issubdtype(update.dtype, jnp.inexact):
        # Integer and bool updates cannot hold NaN; `jnp.isnan` would still
        # build a comparison, so answer statically.
        return jnp.zeros((), jnp.bool_)
    return jnp.any(jnp.isnan(update))


def _zero_nan(update: jax.Array) -> jax.Array:
    update = jnp.asarray(update)  # a Python scalar leaf, as optax accepts
    if not jnp.issubdtype(update.dtype, jnp.inexact):
        return update
    # `where` selects: with a Python zero the result keeps the update's dtype
    # and weak type, and every non-NaN entry passes through bit for bit.
    return jnp.where(jnp.isnan(update), 0, update)


def _init(params):
    return optax.ZeroNansState(
        found_nan=jax.tree.map(lambda _: jnp.zeros((), jnp.bool_), trainable(params))
    )


def _found_nan_like(update, previous):
    """One leaf of the new state: it follows the state's structure, fixed at
    `init`, so that the state keeps its avals whatever the updates hold."""
    if previous is None:
        return None  # not a trainable leaf of the params
    if update is None:
        return jnp.zeros((), jnp.bool_)  # a trainable leaf with no gradient
    return _found_nan(update)


def _update(updates, state, params=None):
    del params
    found_nan = jax.tree.map(
        _found_nan_like, updates, state.found_nan, is_leaf=lambda x: x is None
    )
    return jax.tree.map(_zero_nan, updates), optax.ZeroNansState(found_nan)


def zero_nans() -> optax.GradientTransformation:
    """Replaces every NaN in the updates with zero.

    A drop-in for `optax.zero_nans` with the same state type,
    `optax.ZeroNansState`, whose `found_nan` holds one scalar `bool` per leaf
    of the updates: `True` if that leaf held a NaN at the last `update`.

    What it adds to `optax.zero_nans`:

    - every updates leaf keeps its dtype and weak type (bfloat16 stays
      bfloat16), and `inf` is left as it is: only NaN is replaced;
    - the returned state always holds strongly typed scalar `bool` leaves,
      whatever a wrapper handed back as the previous state, so the state's
      avals never change from step to step (a changing state makes
      `lax.cond`, `lax.scan` and `jax.jit` callers fail or recompile);
    - `None` leaves (Equinox gradients of non-array fields), `optax.MaskedNode`,
      integer leaves and empty trees are accepted. The state's structure is
      fixed by `init`: params leaves that are not floating arrays (an Equinox
      model's activation functions, integer buffers, keys) get `None`, as
      `eqx.filter_grad` gives `None` for them, and a `None` update of a
      floating leaf records `False`.

    Two `zero_nans()` compare equal, so a jitted step that takes the
    optimizer as a static argument does not recompile for a new one.

    It is a pure function of the updates, safe under `jax.jit`, `jax.vmap`,
    `lax.scan` and `jax.grad` (the gradient of a zeroed entry is zero).

    **Returns:**

    An `optax.GradientTransformation`.

    **Example:**

    ```python
    opt = optax.chain(optax_ext.zero_nans(), optax.adam(1e-3))
    ```
    """

    return optax.GradientTransformation(_init, _update)
