"""An inner `init`'s state, recorded and checked (why: docs/design.md, "Guarantees")."""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from ._tree import is_weak


def avals_key(tree: Any) -> tuple | None:
    """`tree`'s structure and leaf avals, hashable; `None` for a leaf without one."""
    treedef, avals = state_record(tree)
    return None if any(aval is None for aval in avals) else (treedef, avals)


def state_record(state: PyTree) -> tuple[Any, tuple]:
    """A tree's structure and leaves' (shape, dtype, weak type); Python numbers weak."""
    leaves, treedef = jax.tree.flatten(state)
    avals = []
    for x in leaves:
        try:
            dtype = jnp.result_type(x)
        except TypeError:
            avals.append(None)
            continue
        shape = tuple(x.shape) if hasattr(x, "shape") else jnp.shape(x)
        weak = is_weak(x) or isinstance(x, int | float | complex)
        avals.append((shape, dtype, weak))
    return treedef, tuple(avals)


def traced_state_record(
    init: Any, template: PyTree, known: dict, *, is_params: bool
) -> tuple[Any, tuple | None] | None:
    """`state_record` of `init(template)`, traced abstractly, cached in `known`."""
    key = avals_key(template)
    key = None if key is None else (is_params, key)
    if key is not None and key in known:
        return known[key]
    try:
        record = state_record(jax.eval_shape(init, template))
    except Exception:  # noqa: BLE001 - an init that needs real params
        record = None  # no check
    if record is not None and not is_params:
        record = (record[0], None)
    if key is not None:
        known[key] = record
    return record


def check_state_structure(
    init: Any,
    state: PyTree,
    template: PyTree,
    known: dict,
    *,
    is_params: bool,
    names: tuple[str, str, str],
) -> tuple[Any, tuple | None] | None:
    """Raises unless `state` has `init(template)`'s tree; returns the record."""
    who, state_name, owner = names
    record = traced_state_record(init, template, known, is_params=is_params)
    if record is None:
        return None
    got, expected = jax.tree.structure(state), record[0]
    if got != expected:
        raise TypeError(
            f"{who}'s `{state_name}` does not have the structure of the inner "
            f"optimizer's state: got {got}, expected {expected}. Pass the "
            f"state that this {owner}'s init returned (not one "
            "built by another optimizer)."
        )
    return record


def strong_as_recorded(
    state: PyTree, record: tuple[Any, tuple | None] | None
) -> PyTree:
    """`state` with each weak leaf made strong where `record` has it strong."""
    if record is None or record[1] is None:
        return state
    leaves, treedef = jax.tree.flatten(state)
    if treedef != record[0]:
        return state
    out = []
    for x, aval in zip(leaves, record[1], strict=True):
        strong = aval is not None and not aval[2] and is_weak(x)
        if strong and (tuple(jnp.shape(x)), jnp.result_type(x)) == aval[:2]:
            x = lax.convert_element_type(x, aval[1])
        out.append(x)
    return jax.tree.unflatten(treedef, out)
