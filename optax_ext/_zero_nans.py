"""`zero_nans`: replace NaN in updates with zero, keeping every dtype."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._leaves import is_typed_key


def _found_nan(update: jax.Array) -> jax.Array:
    update = jnp.asarray(update)
    if not jnp.issubdtype(update.dtype, jnp.inexact):  # no NaN: no comparison
        return jnp.zeros((), jnp.bool_)
    return jnp.any(jnp.isnan(update))


def _zero_nan(update: jax.Array) -> jax.Array:
    update = jnp.asarray(update)  # a Python scalar leaf, as optax accepts
    if not jnp.issubdtype(update.dtype, jnp.inexact):
        return update
    # A select with a Python zero keeps the dtype, weak type and other bits.
    return jnp.where(jnp.isnan(update), 0, update)


def _tracked(x) -> bool:
    """A params leaf that gets a `found_nan` entry: a numeric array or Python
    number (not a key or function, as `eqx.filter_grad`)."""
    if isinstance(x, (bool, int, float, complex)):
        return True
    return eqx.is_array(x) and not is_typed_key(x)


def _init(params):
    return optax.ZeroNansState(
        found_nan=jax.tree.map(
            lambda x: jnp.zeros((), jnp.bool_) if _tracked(x) else None, params
        )
    )


def _found_nan_like(update, previous):
    """One leaf of the new state, in the structure `init` fixed."""
    if previous is None:
        return None  # not a numeric leaf of the params
    if update is None:
        return jnp.zeros((), jnp.bool_)  # a numeric leaf with no gradient
    return _found_nan(update)


def _found_nans(updates, state):
    """`found_nan` in the structure of `init`'s state, or of the updates where
    there is none to follow (as optax, which ignores the state)."""
    previous = getattr(state, "found_nan", None) if state is not None else None
    if previous is not None or isinstance(state, optax.ZeroNansState):
        try:
            return jax.tree.map(
                _found_nan_like, updates, previous, is_leaf=lambda x: x is None
            )
        except (ValueError, TypeError):
            pass  # another tree than init's: as optax, follow the updates
    return jax.tree.map(_found_nan, updates)


def _update(updates, opt_state, params=None):
    del params
    found_nan = _found_nans(updates, opt_state)
    return jax.tree.map(_zero_nan, updates), optax.ZeroNansState(found_nan)


def zero_nans() -> optax.GradientTransformation:
    """Replaces every NaN in the updates with zero.

    A drop-in for `optax.zero_nans` with the same state type,
    `optax.ZeroNansState`, whose `found_nan` holds one scalar `bool` per leaf
    of the updates: `True` if that leaf held a NaN at the last `update`.

    What it adds to `optax.zero_nans`:

    - every updates leaf keeps its dtype and weak type, and `inf` is left as
      it is: only NaN is replaced;
    - the state always holds strongly typed scalar `bool` leaves, so its
      avals never change from step to step, whatever a wrapper handed back;
    - `None` leaves, `optax.MaskedNode`, integer leaves, Python numbers and
      empty trees are accepted, with optax's results. `init` fixes the
      state's structure: a `found_nan` entry per numeric params leaf, `None`
      for a function or PRNG key; a `None` update records `False`;
    - as in optax, the state is only a template: `update(updates, None)`
      works, and updates of another tree get a `found_nan` of their own.

    Two `zero_nans()` compare equal. Safe under `jax.jit`, `jax.vmap`,
    `lax.scan` and `jax.grad` (a zeroed entry's gradient is zero).
    Details: docs/zero_nans.md.

    **Returns:**

    An `optax.GradientTransformation`.

    **Example:**

    ```python
    opt = optax.chain(optax_ext.zero_nans(), optax.adam(1e-3))
    ```
    """
    return optax.GradientTransformation(_init, _update)
