"""Which leaves of params and updates the transformations act on: one
vocabulary of leaf kinds, and the filters and gap fillers built on it.

- a *differentiated* leaf: a floating or complex array, what
  `eqx.filter_grad` gives a gradient (`is_differentiated`);
- an *optimised* leaf: a differentiated one or a Python `float` or
  `complex`, what optax keeps optimizer state for (`is_optimised`);
- a *passive* leaf: any other leaf but `None` (integer, bool and key arrays,
  Python `int`s, functions): no state, a zero or `None` update
  (`is_passive`);
- an *integer* leaf: an integer array (not bool, not a key) or a Python
  `int`, which `optax.MultiSteps` accumulates too (`is_integer`);
- a *weak number*: a Python `float` or `complex`, or a weakly typed
  floating array, what `jax.jit` makes of a Python float (`is_weak_number`).
"""

from __future__ import annotations

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


def _is_python_inexact(x: Any) -> bool:
    return isinstance(x, (float, complex))


def is_optimised(x: Any) -> bool:
    """A differentiated leaf or a Python `float` or `complex`: `jax.grad`
    gives the number a gradient and optax keeps state for it
    (`optax.adam(...).init({"s": 0.5})` has a moment for `s`)."""
    return is_differentiated(x) or _is_python_inexact(x)


def is_passive(x: Any) -> bool:
    """A leaf that is neither `None` nor optimised."""
    return x is not None and not is_optimised(x)


def is_integer(x: Any) -> bool:
    """An integer array (not `bool`, not a PRNG key) or a Python `int` (not
    `bool`)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and eqx.is_array(x)
        and not is_typed_key(x)
        and jnp.issubdtype(dtype, jnp.integer)
    )


def is_weak_number(x: Any) -> bool:
    """A Python `float` or `complex`, or a weakly typed floating (or
    complex) array."""
    return _is_python_inexact(x) or (
        is_differentiated(x) and bool(getattr(x, "weak_type", False))
    )


def _keep(tree: PyTree, kind: Any) -> PyTree:
    """`tree` with `None` for each leaf that is not of `kind`."""
    return jax.tree.map(lambda x: x if kind(x) else None, tree)


def differentiated(tree: PyTree) -> PyTree:
    """The differentiated leaves of `tree`, `None` elsewhere: the leaves
    `eqx.filter_grad` gives a gradient, and `eqx.apply_updates` skips a
    `None` update. A state built from a whole Equinox model holds `None` at
    the same places, or `jnp.zeros_like(jax.nn.relu)` raises (equinox issue
    #590)."""
    return _keep(tree, is_differentiated)


def optimised(tree: PyTree) -> PyTree:
    """The optimised leaves of `tree`, `None` elsewhere, as optax keeps
    state."""
    return _keep(tree, is_optimised)


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def accumulated(tree: PyTree) -> PyTree:
    """The leaves `optax_ext.MultiSteps` accumulates gradients for, `None`
    elsewhere. Inside an `equinox.Module` the optimised leaves, so a model's
    integer buffers, keys and functions hold `None`, as `eqx.filter_grad`
    gives them; elsewhere (dicts, lists, tuples, a bare array) integer leaves
    too, as `optax.MultiSteps` accumulates integer gradients."""

    def keep(x: Any) -> Any:
        if _is_module(x):
            return optimised(x)
        return x if is_optimised(x) or is_integer(x) else None

    return jax.tree.map(keep, tree, is_leaf=_is_module)


def _strong(x: Any) -> jax.Array:
    return lax.convert_element_type(x, jnp.result_type(x))


def inner_params(params: PyTree) -> PyTree:
    """`optimised(params)` with each weak number made a strongly typed array
    of its dtype: the params an inner optimizer is given.

    Its state for such a leaf is then strongly typed from `init` on. Built
    from the Python number itself, a moment is weakly typed at `init` and
    comes back strong from `update` (`optax.adam`'s second moment does), so
    a jitted train step holding it compiles twice (an Equinox model's
    `Dropout.p`). The values are the same either way.
    """
    return jax.tree.map(
        lambda x: _strong(x) if is_weak_number(x) else x, optimised(params)
    )


def updates_for_inner(updates: PyTree, params: PyTree) -> PyTree:
    """`updates` aligned with `inner_params(params)`, for `params` as the
    caller was given them: `None` where the param is passive (no state is
    kept for it); where the param is a weak number, the update as a strongly
    typed array, a zero where it is `None` (`eqx.filter_grad` gives a
    model's `float` field no gradient, optax a state entry). The caller puts
    back what it was given with `updates_for_params`. Trees that do not line
    up are returned unchanged, for the inner optimizer to judge."""
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

    try:
        return jax.tree.map(fill, updates, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return updates


def updates_for_params(original: PyTree, new: PyTree, params: PyTree) -> PyTree:
    """The inner optimizer's `new` updates (of `updates_for_inner`) for the
    params: `None` where `original` (the incoming updates) had it, and a zero
    in the dtype of the update given where the param is passive (it stays
    as it is)."""
    if params is None:
        return restore_none(original, new)

    def back(o: Any, n: Any, p: Any) -> Any:
        if o is None:
            return None
        if is_passive(p):
            dtype = jnp.result_type(o)
            return o if dtype == jax.dtypes.float0 else jnp.zeros(jnp.shape(o), dtype)
        return n

    try:
        return jax.tree.map(back, original, new, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return restore_none(original, new)


def zeros_where_undifferentiated(updates: PyTree, params: PyTree) -> PyTree:
    """`updates` with a zero where it holds `None` and `params` (as given by
    `accumulated`) a leaf that is not differentiated: a Python number or an
    integer array, which `eqx.filter_grad` gives no gradient but optax keeps
    state for. The caller puts the `None` back with `restore_none`. Trees
    that do not line up are returned unchanged, for the caller's structure
    check to report."""
    if params is None:
        return updates

    def fill(u: Any, p: Any) -> Any:
        if u is None and p is not None and not is_differentiated(p):
            return jnp.zeros_like(p)
        return u

    try:
        return jax.tree.map(fill, updates, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return updates


def restore_none(original: PyTree, new: PyTree) -> PyTree:
    """`new` with `None` wherever `original` (the incoming updates) had it."""
    if not any(x is None for x in jax.tree.leaves(original, is_leaf=is_none)):
        return new
    try:
        return jax.tree.map(
            lambda o, n: None if o is None else n, original, new, is_leaf=is_none
        )
    except (ValueError, TypeError):
        return new
