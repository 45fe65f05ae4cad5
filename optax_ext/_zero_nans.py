"""`zero_nans`: replace NaN in updates with zero, keeping every dtype."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._leaves import is_typed_key


def _found_nan(update: jax.Array | None) -> jax.Array:
    """Whether `update` holds a NaN (`None`, no gradient, and integers hold none)."""
    if update is None or not jnp.issubdtype(jnp.result_type(update), jnp.inexact):
        return jnp.zeros((), jnp.bool_)
    return jnp.any(jnp.isnan(update))


def _zero_nan(update: jax.Array) -> jax.Array:
    update = jnp.asarray(update)  # a Python scalar leaf, as optax accepts
    if not jnp.issubdtype(update.dtype, jnp.inexact):
        return update
    # A select with a Python zero keeps the dtype, weak type and other bits.
    return jnp.where(jnp.isnan(update), 0, update)


def _tracked(x) -> bool:
    """A params leaf with a `found_nan` entry: a number, not a key or function."""
    numeric_array = eqx.is_array(x) and not is_typed_key(x)
    return isinstance(x, (bool, int, float, complex)) or numeric_array


def _init(params):
    found_nan = lambda x: jnp.zeros((), jnp.bool_) if _tracked(x) else None
    return optax.ZeroNansState(jax.tree.map(found_nan, params))


def _found_nans(updates, state):
    """`found_nan` in the structure of `init`'s state, else of the updates (as
    optax, which ignores the state)."""
    previous = getattr(state, "found_nan", None)
    if previous is not None or isinstance(state, optax.ZeroNansState):
        try:
            found = lambda u, p: None if p is None else _found_nan(u)
            return jax.tree.map(found, updates, previous, is_leaf=lambda x: x is None)
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

    Unlike `optax.zero_nans`, every updates leaf keeps its dtype and weak
    type, and the state's leaves are always strong scalar bools (`None` for
    a function or PRNG key leaf). Details: docs/zero_nans.md.

    **Returns:**

    An `optax.GradientTransformation`.

    **Example:**

    ```python
    opt = optax.chain(optax_ext.zero_nans(), optax.adam(1e-3))
    ```
    """
    return optax.GradientTransformation(_init, _update)
