"""Running an inner optimizer on some steps only, by one `lax.cond`.

`update_if(pred, inner_update, grads, inner_state)` is the inner update
where `pred`, zero updates and the state as it came in elsewhere, typed
alike in both branches. It traces the inner update once, asks
`_dataflow` which outputs read which inputs, and orders the writes over
read buffers (`_ordering`) so that XLA keeps every state leaf in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from ._dataflow import grad_readers, state_read_by_updates
from ._leaves import is_typed_key
from ._ordering import (
    bit_width,
    opaque_true,
    order_state_writes,
    orderable,
    outputs_before_clear,
    read_token,
    zeros_in_place,
)
from ._sharding import (
    aval_varying_axes,
    cast_varying,
    sharded_type,
    varying_axes,
    zeros_like_struct,
)
from ._tree import cast_like, check_same_shapes


def update_if(
    pred: jax.Array,
    inner_update: Callable[..., tuple[PyTree, PyTree]],
    grads: PyTree,
    inner_state: PyTree,
    *,
    clear_grads: bool = False,
    carry: PyTree = None,
) -> tuple[PyTree, PyTree, PyTree | None]:
    """`inner_update(grads, inner_state)` where `pred`, else zero updates and
    `inner_state` as it came in.

    The zeros have the dtypes of the inner optimizer's updates (not of
    `grads`), and the new state is conformed to the old one's avals, so both
    branches of the `cond` agree exactly and the caller's state never changes
    type. Under `vmap` with a batched `pred` the `cond` becomes a select.
    `inner_update` is traced once (nesting `update_if` does not multiply
    traces).

    With `carry` (the params of a fused train step), `inner_update` is
    called as `inner_update(grads, inner_state, carry)` and returns the new
    carry in place of updates; where `pred` is false the carry comes back
    as it went in.

    With `clear_grads`, the third output is `grads` cleared to zeros where
    the inner update ran and `grads` as they came in elsewhere; `None`
    otherwise. The clear and any state leaf whose old value the updates
    read (Lion's `mu`) are ordered after those reads (`_ordering`), so XLA
    writes them in place.
    """

    carried = carry is not None

    def step(grads, inner_state, carry):
        if carried:
            new_carry, new_inner_state = inner_update(grads, inner_state, carry)
            new_carry = conform_state(new_carry, carry)
        else:
            new_carry, new_inner_state = inner_update(grads, inner_state)
        return new_carry, conform_state(new_inner_state, inner_state)

    operands = (grads, inner_state, carry)
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        # `jit` would run `step` again in the branch, once more per level.
        closed, (out_shapes, state_shapes) = jax.make_jaxpr(step, return_shape=True)(
            *operands
        )
        n_consts = 0  # closed-over values are the jaxpr's consts
        call = lambda *args: jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))  # noqa: E731
    else:
        # Called in the running branch, where `jit`'s cache holds this
        # trace; `inline` copies its equations there (docs/design.md).
        call = jax.jit(step, inline=True)
        traced = call.trace(*operands)
        closed = traced.jaxpr
        out_shapes, state_shapes = traced.out_info
        # Values `step` closes over (tracers of the caller) lead the invars.
        n_consts = len(closed.jaxpr.invars) - len(jax.tree.leaves(operands))
    n_grads = len(jax.tree.leaves(grads))
    n_state = len(jax.tree.leaves(inner_state))
    n_updates = len(jax.tree.leaves(out_shapes))
    readers = state_read_by_updates(
        closed.jaxpr,
        n_grads=n_grads,
        n_updates=n_updates,
        n_state=n_state,
        n_consts=n_consts,
    )
    reading_grads = grad_readers(closed.jaxpr, n_grads=n_grads, n_consts=n_consts)
    out_def = jax.tree.structure((out_shapes, state_shapes))
    out_avals = closed.out_avals

    def run(traced_pred, grads, inner_state, carry):
        leaves = jax.tree.leaves(call(grads, inner_state, carry))
        # Evaluated eagerly, a constant output is a Python or NumPy value.
        leaves = [cast_like(x, a) for x, a in zip(leaves, out_avals, strict=True)]
        update_leaves = leaves[:n_updates]
        state_leaves, ordered, followed = order_state_writes(
            update_leaves, leaves[n_updates:], readers, traced_pred
        )
        if clear_grads:
            to_read = outputs_before_clear(
                reading_grads, state_leaves, ordered, followed, n_updates, traced_pred
            )
        new_updates, new_inner_state = jax.tree.unflatten(
            out_def, [*update_leaves, *state_leaves]
        )
        if not clear_grads:
            return new_updates, new_inner_state, None
        outputs = [*update_leaves, *state_leaves]
        token = read_token([outputs[i] for i in to_read], traced_pred)
        return new_updates, new_inner_state, zeros_in_place(grads, token)

    def skip(traced_pred, grads, inner_state, carry):
        kept = carry
        if not carried:
            kept = _typed_like(
                _distinct_zeros(out_shapes, traced_pred), out_avals[:n_updates]
            )
        return kept, inner_state, (grads if clear_grads else None)

    # `pred` goes in as an operand, made opaque to XLA: inside the running
    # branch it is a `True` that XLA cannot fold, which the tokens and the
    # tagged zeros rely on, even where `pred` itself is a constant.
    traced_pred = pred
    opaque = opaque_true(jax.tree.leaves((inner_state, grads)))
    if opaque is not None:
        traced_pred = lax.bitwise_and(pred, opaque)
    # Where a state leaf is ordered after the updates the conditional must
    # stay one (inlined, XLA fused past the token). Otherwise `pred`
    # indexes: XLA inlines a conditional whose `pred` it folds, and under
    # `vmap` an unbatched `pred` keeps it a conditional (docs/design.md).
    ordering = any(
        orderable(aval) and reads
        for aval, reads in zip(out_avals[n_updates:], readers, strict=True)
    )
    return lax.cond(
        traced_pred if ordering else pred,
        run,
        skip,
        traced_pred,
        grads,
        inner_state,
        carry,
    )


# Leaves from this many elements get zeros of their own (`_distinct_zeros`);
# below it a copy of a shared broadcast costs less than one more kernel to
# launch and to compile.
DISTINCT_ZEROS_MIN_SIZE = 1 << 16


def _typed_like(zeros: PyTree, avals: list[Any]) -> PyTree:
    """`zeros` typed as varying over the mesh axes that the running branch's
    outputs (`avals`) vary over inside `jax.shard_map` (updates of params
    sharded over a manual axis), so that both branches agree."""
    leaves, treedef = jax.tree.flatten(zeros)
    out = []
    for z, aval in zip(leaves, avals, strict=True):
        axes = (aval_varying_axes(aval) or frozenset()) - (
            varying_axes(z) or frozenset()
        )
        out.append(cast_varying(z, tuple(sorted(axes))) if axes else z)
    return jax.tree.unflatten(treedef, out)


def _distinct_zeros(structs: PyTree, traced_pred: jax.Array) -> PyTree:
    """Zeros shaped like `structs`, no two large leaves the same computation.

    Zeros of one shape are one broadcast to XLA, which then copies it into
    each output of the `cond` that holds it (a read and a write per leaf).
    Here a leaf `i` of at least `DISTINCT_ZEROS_MIN_SIZE` elements
    broadcasts its own scalar, `where(traced_pred, tag_i, 0)`, with
    `traced_pred` a `False` that XLA cannot fold and `tag_i` the bits of
    `i + 1`: nothing to merge, and it is written once, straight into its
    output."""
    leaves, treedef = jax.tree.flatten(structs)
    return jax.tree.unflatten(
        treedef, [_tagged_zeros(s, i, traced_pred) for i, s in enumerate(leaves)]
    )


def _tagged_zeros(struct: Any, i: int, traced_pred: jax.Array) -> jax.Array:
    dtype = jnp.dtype(struct.dtype)
    width = bit_width(dtype)
    small = math.prod(struct.shape) < DISTINCT_ZEROS_MIN_SIZE
    if width is None or small:
        return zeros_like_struct(struct)
    real = jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else dtype
    bits = jnp.asarray((i + 1) % 2**width, jnp.dtype(f"uint{width}"))
    tag = lax.convert_element_type(lax.bitcast_convert_type(bits, real), dtype)
    fill = lax.select(traced_pred, tag, lax.full((), 0, dtype))
    if sharded_type(struct):  # `Explicit` axes: the sharding is in the type
        return lax.full(struct.shape, fill, dtype, sharding=struct.sharding)
    return lax.broadcast(fill, struct.shape)


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
        if is_typed_key(o):
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
