"""Leaf kinds (docs/design.md, "Which leaves are acted on"), filters, gap fillers."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree


def is_none(x: Any) -> bool:
    """`is_leaf` for maps that keep `None` leaves (`eqx.filter_grad`'s)."""
    return x is None


def is_typed_key(x: Any) -> bool:
    """A typed PRNG key array (`jax.random.key(...)`), of any shape."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_differentiated(x: Any) -> bool:
    """A floating or complex array: what `eqx.filter_grad` differentiates."""
    return eqx.is_inexact_array(x)


def is_optimised(x: Any) -> bool:
    """A differentiated leaf or a Python `float` or `complex` (optax keeps state)."""
    return is_differentiated(x) or isinstance(x, (float, complex))


def is_passive(x: Any) -> bool:
    """A leaf that is neither `None` nor optimised."""
    return x is not None and not is_optimised(x)


def is_integer(x: Any) -> bool:
    """An integer array (not bool, not a key) or a Python `int` (not bool)."""
    if isinstance(x, int):
        return not isinstance(x, bool)
    if not eqx.is_array(x) or is_typed_key(x):
        return False
    return jnp.issubdtype(x.dtype, jnp.integer)


def is_weak_number(x: Any) -> bool:
    """A Python `float` or `complex`, or a weakly typed inexact array."""
    return isinstance(x, (float, complex)) or (
        is_differentiated(x) and bool(getattr(x, "weak_type", False))
    )


def _keep(tree: PyTree, kind: Any) -> PyTree:
    """`tree` with `None` for each leaf that is not of `kind`."""
    return jax.tree.map(lambda x: x if kind(x) else None, tree)


def differentiated(tree: PyTree) -> PyTree:
    """The differentiated leaves of `tree`, `None` elsewhere (equinox #590)."""
    return _keep(tree, is_differentiated)


def optimised(tree: PyTree) -> PyTree:
    """The optimised leaves of `tree`, `None` elsewhere."""
    return _keep(tree, is_optimised)


def accumulated(tree: PyTree) -> PyTree:
    """Optimised leaves, integer ones too outside an `eqx.Module` (as optax)."""

    def keep(x: Any) -> Any:
        if isinstance(x, eqx.Module):
            return optimised(x)
        return x if is_optimised(x) or is_integer(x) else None

    return jax.tree.map(keep, tree, is_leaf=lambda x: isinstance(x, eqx.Module))


def _map_or(default: Callable[[], Any], fn: Callable, *trees: PyTree) -> PyTree:
    """`jax.tree.map(fn, *trees)` keeping `None`; `default()` where they differ."""
    try:
        return jax.tree.map(fn, *trees, is_leaf=is_none)
    except (ValueError, TypeError):
        return default()


def _strong(x: Any) -> jax.Array:
    return lax.convert_element_type(x, jnp.result_type(x))


def inner_params(params: PyTree) -> PyTree:
    """`optimised(params)`, weak numbers strong (the inner state keeps its avals)."""
    return jax.tree.map(
        lambda x: _strong(x) if is_weak_number(x) else x, optimised(params)
    )


def updates_for_inner(updates: PyTree, params: PyTree) -> PyTree:
    """`updates` fit for `inner_params(params)` (undone by `updates_for_params`)."""
    if params is None:
        return updates

    def fill(u: Any, p: Any) -> Any:
        if is_passive(p):
            return None
        if not is_weak_number(p):
            return u
        if u is None:
            return jnp.zeros(jnp.shape(p), jnp.result_type(p))
        return _strong(u) if is_weak_number(u) else u

    return _map_or(lambda: updates, fill, updates, params)


def updates_for_params(original: PyTree, new: PyTree, params: PyTree) -> PyTree:
    """Inner `new` updates for the params: `original`'s `None`s, zeros if passive."""
    if params is None:
        return restore_none(original, new)

    def back(o: Any, n: Any, p: Any) -> Any:
        if o is None:
            return None
        if is_passive(p):
            dtype = jnp.result_type(o)
            return o if dtype == jax.dtypes.float0 else jnp.zeros(jnp.shape(o), dtype)
        return n

    return _map_or(lambda: restore_none(original, new), back, original, new, params)


def zeros_where_undifferentiated(updates: PyTree, params: PyTree) -> PyTree:
    """Zeros for `None` updates of undifferentiated leaves (undone: `restore_none`)."""
    if params is None:
        return updates

    def fill(u: Any, p: Any) -> Any:
        if u is None and p is not None and not is_differentiated(p):
            return jnp.zeros_like(p)
        return u

    return _map_or(lambda: updates, fill, updates, params)


def restore_none(original: PyTree, new: PyTree) -> PyTree:
    """`new` with `None` wherever `original` (the incoming updates) had it."""
    if not any(x is None for x in jax.tree.leaves(original, is_leaf=is_none)):
        return new
    return _map_or(lambda: new, lambda o, n: None if o is None else n, original, new)
