"""Running an inner optimizer on some steps only, by one `lax.cond`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from ._sharding import zeros_like_struct
from ._tree import cast_like, check_same_shapes

PyTree = Any


def check_transformation(value: Any, name: str) -> None:
    """Raises a `TypeError` unless `value` has callable `init` and `update`."""
    if not (
        callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    ):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (with `init` and "
            f"`update`), got {value!r} of type {type(value).__name__}."
        )


def update_if(
    pred: jax.Array,
    inner_update: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    grads: PyTree,
    inner_state: PyTree,
) -> tuple[PyTree, PyTree]:
    """`inner_update(grads, inner_state)` where `pred`, else zero updates and
    `inner_state` as it came in.

    The zeros have the dtypes of the inner optimizer's updates (not of
    `grads`), and the new state is conformed to the old one's avals, so both
    branches of the `cond` agree exactly and the caller's state never changes
    type. Under `vmap` with a batched `pred` the `cond` becomes a select.
    """
    out_shapes, _ = jax.eval_shape(inner_update, grads, inner_state)

    def run(grads, inner_state):
        new_updates, new_inner_state = inner_update(grads, inner_state)
        return new_updates, conform_state(new_inner_state, inner_state)

    def skip(grads, inner_state):
        del grads
        zeros = jax.tree.map(zeros_like_struct, out_shapes)
        return zeros, inner_state

    return lax.cond(pred, run, skip, grads, inner_state)


def conform_state(new: PyTree, old: PyTree) -> PyTree:
    """Gives each leaf of the inner optimizer's new state its old dtype and weak
    type, so that both branches of the `lax.cond` agree exactly."""
    new_leaves, new_def = jax.tree.flatten(new)
    old_leaves, old_def = jax.tree.flatten(old)
    if new_def != old_def:
        raise ValueError(
            "The inner optimizer returned a state with another tree structure "
            f"than it was given: {new_def} instead of {old_def}; a state that is "
            "kept on some steps must keep its structure."
        )
    check_same_shapes(
        old,
        new,
        expected_name="the inner state it was given",
        got_name="the inner optimizer's new state",
        hint="a state that is kept on some steps must keep its shapes.",
    )
    leaves = []
    for path_leaf, n, o in zip(
        jax.tree_util.tree_flatten_with_path(old)[0],
        new_leaves,
        old_leaves,
        strict=True,
    ):
        if jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key):
            if n.dtype != o.dtype:
                raise ValueError(
                    f"The inner optimizer changed the key type of its state leaf "
                    f"at {jax.tree_util.keystr(path_leaf[0])} from {o.dtype} to "
                    f"{n.dtype}."
                )
            leaves.append(n)
        else:
            leaves.append(cast_like(n, o))
    return jax.tree.unflatten(old_def, leaves)
