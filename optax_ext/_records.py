"""What an inner optimizer's `init` builds, recorded without running it:
the tree and each leaf's (shape, dtype, weak type) of its state, traced
abstractly from the params' avals and cached by them. The wrappers check a
state against the record and return it with init's weak types.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from ._tree import is_weak


def avals_key(tree: Any) -> tuple | None:
    """A hashable key of what tracing a function of `tree` depends on: its
    structure and each leaf's shape, dtype and weak type (Python numbers
    count as weakly typed); `None` where a leaf is not an array or number."""
    treedef, avals = state_record(tree)
    return None if any(aval is None for aval in avals) else (treedef, avals)


def state_record(state: PyTree) -> tuple[Any, tuple]:
    """A tree's structure and each leaf's (shape, dtype, weak type), `None`
    for a leaf without a dtype (Python numbers count as weakly typed): of
    the state an `init` called on real params built, for
    `strong_as_recorded`, and the parts of `avals_key`."""
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
    """The `state_record` of what `init` builds from params like `template`,
    traced abstractly: with each leaf's avals where `is_params` (`template`
    is what `init` is given), the structure alone (`(treedef, None)`) where
    it stands in for them (the accumulator, say: its dtypes need not be the
    params'); `None` where `init` cannot be traced without real params.

    `known` caches the answers by `avals_key` of `template`; `init` fills
    it with the same call, so the step traces no inner init for params
    `init` has seen, and an optimizer that never ran `init` computes the
    same record."""
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
    who: str,
    state_name: str,
    owner: str,
) -> tuple[Any, tuple | None] | None:
    """Raises a `TypeError` if `state` is not shaped like what `init` builds
    from params shaped like `template` (another optimizer's state was
    passed). Returns `traced_state_record`'s record, for
    `strong_as_recorded`."""
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
    """`state` with each weakly typed leaf made strong where `init` built it
    strong with the same shape and dtype (`record`, from `state_record`): a
    value written into the state as `jnp.asarray(1e-2)` where init stored a
    float32 array, which a conditional returning the state as it came in
    would keep weak for good. Applied to the state a step returns, not to
    the one the inner optimizer reads (which sees what was written, as it
    would unwrapped). The value is unchanged; other leaves, and every leaf
    where `record` holds no avals, are returned as they are."""
    if record is None or record[1] is None:
        return state
    leaves, treedef = jax.tree.flatten(state)
    if treedef != record[0]:
        return state
    out = []
    for x, aval in zip(leaves, record[1], strict=True):
        if (
            aval is not None
            and not aval[2]
            and is_weak(x)
            and jnp.result_type(x) == aval[1]
            and tuple(jnp.shape(x)) == aval[0]
        ):
            x = lax.convert_element_type(x, aval[1])
        out.append(x)
    return jax.tree.unflatten(treedef, out)
