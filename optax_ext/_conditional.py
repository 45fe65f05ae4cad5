"""Running an inner optimizer on some steps only, by one `lax.cond`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from ._sharding import is_local, zeros_like_struct
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
    *,
    clear_grads: bool = False,
) -> tuple[PyTree, PyTree, PyTree | None]:
    """`inner_update(grads, inner_state)` where `pred`, else zero updates and
    `inner_state` as it came in.

    The zeros have the dtypes of the inner optimizer's updates (not of
    `grads`), and the new state is conformed to the old one's avals, so both
    branches of the `cond` agree exactly and the caller's state never changes
    type. Under `vmap` with a batched `pred` the `cond` becomes a select.

    With `clear_grads`, the third output is `grads` cleared to zeros where
    `pred` (the inner update ran) and `grads` as they came in elsewhere; it is
    `None` otherwise. This is how a buffer that the inner update reads (an
    accumulator) is reset in place: the zeros are written in the running
    branch, ordered after every output of the inner update that reads
    `grads` (by the dependency described below), so that XLA may write them
    over `grads`. The same reset done after the `cond`, by a select, leaves
    the accumulated values in a buffer of their own, a params-sized
    temporary, and copies them back on every step.

    In the running branch, a state leaf whose old value the updates read
    directly (not through its new value: Lion's `mu`, read for
    `sign(b1 * mu + ...)` and for the new `mu`) is given a data dependency on
    those updates (see `_after`), so that XLA may write the new value over the
    old one. Without it XLA cannot order the two reads before the write, keeps
    the state in another buffer than the donated one, and copies it on every
    step, in the non-running branch too. The dependency costs, on running
    steps only, one element read from each of those updates and a select
    fused into the loop that writes the new value. It relies on XLA not fusing
    that one-element read with the loop that produces the update (true of
    XLA on CPU, checked in `tests/test_hlo.py`); where it is fused, the
    dependency is lost and XLA copies as before: the values never change.
    """

    def step(grads, inner_state):
        new_updates, new_inner_state = inner_update(grads, inner_state)
        return new_updates, conform_state(new_inner_state, inner_state)

    closed, (out_shapes, _) = jax.make_jaxpr(step, return_shape=True)(
        grads, inner_state
    )
    n_grads = len(jax.tree.leaves(grads))
    n_updates = len(jax.tree.leaves(out_shapes))
    readers = _updates_reading_old_state(
        closed.jaxpr, n_grads=n_grads, n_updates=n_updates
    )
    grad_readers = _outputs_reading_grads(closed.jaxpr, n_grads=n_grads)

    def run(grads, inner_state):
        new_updates, new_inner_state = step(grads, inner_state)
        # Flags of the update leaves, by index: shared by both dependencies.
        flags: dict[int, jax.Array | None] = {}
        new_inner_state = _after(new_updates, new_inner_state, readers, flags)
        if not clear_grads:
            return new_updates, new_inner_state, None
        outputs = jax.tree.leaves((new_updates, new_inner_state))
        for i in grad_readers:
            if i not in flags:
                flags[i] = _always_true(outputs[i])
        done = [flags[i] for i in grad_readers]
        done = [flag for flag in done if flag is not None]
        return new_updates, new_inner_state, _zeros_after(grads, done)

    def skip(grads, inner_state):
        zeros = jax.tree.map(zeros_like_struct, out_shapes)
        return zeros, inner_state, (grads if clear_grads else None)

    return lax.cond(pred, run, skip, grads, inner_state)


def _outputs_reading_grads(jaxpr: Any, *, n_grads: int) -> list[int]:
    """Indices of the outputs (updates, then new state) of `step`'s jaxpr
    whose value depends on the first `n_grads` inputs. Equations with inner
    jaxprs pass every input's dependency to every output, which can only add
    outputs."""
    reading = set(jaxpr.invars[:n_grads])
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in reading for v in eqn.invars):
            reading.update(eqn.outvars)
    return [
        i
        for i, v in enumerate(jaxpr.outvars)
        if isinstance(v, jex_core.Var) and v in reading
    ]


def _zeros_after(grads: PyTree, done: list[jax.Array]) -> PyTree:
    """Zeros shaped like `grads`, each computed as `where(all(done), 0, g)`:
    elementwise from `g`, so XLA may write it over `g`, and after every flag
    in `done` is, so after the reads of `g` that those flags follow. Where
    `done` misses a reader XLA orders nothing and copies; the values are
    zeros all the same."""
    if not done:
        return jax.tree.map(jnp.zeros_like, grads)
    flag = functools.reduce(jnp.logical_and, done)
    return jax.tree.map(lambda g: jnp.where(flag, jnp.zeros_like(g), g), grads)


def _updates_reading_old_state(
    jaxpr: Any, *, n_grads: int, n_updates: int
) -> list[tuple[int, ...] | None]:
    """For each state leaf of `step`'s jaxpr: the indices of the update leaves
    that depend on its old value other than through its new value, or `None`
    where the leaf is returned as it came in (nothing is written over it).

    A forward pass over the equations with one bit per state leaf; the bit of
    leaf `i` is not propagated past the variable that is its new value.
    Equations with inner jaxprs (`jit`, `scan`, ...) pass every input's bits to
    every output, which can only add dependencies. Only reads by the updates
    are found: a leaf whose old value only another leaf's new value reads is
    left to XLA (which copies where it cannot order them).
    """
    state_in = jaxpr.invars[n_grads:]
    new_state = jaxpr.outvars[n_updates:]
    bits: dict[Any, int] = {}
    for i, v in enumerate(state_in):
        bits[v] = bits.get(v, 0) | (1 << i)
    blocked: dict[Any, int] = {}
    for i, v in enumerate(new_state):
        if isinstance(v, jex_core.Var) and v is not state_in[i]:
            blocked[v] = blocked.get(v, 0) | (1 << i)

    def of(v: Any) -> int:
        return 0 if isinstance(v, jex_core.Literal) else bits.get(v, 0)

    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            mask |= of(v)
        if mask:
            for v in eqn.outvars:
                bits[v] = mask & ~blocked.get(v, 0)
    update_bits = [of(v) for v in jaxpr.outvars[:n_updates]]
    return [
        None
        if new is old
        else tuple(j for j, b in enumerate(update_bits) if b >> i & 1)
        for i, (old, new) in enumerate(zip(state_in, new_state, strict=True))
    ]


def _always_true(update: jax.Array) -> jax.Array | None:
    """A scalar `True` that XLA cannot compute before `update` is: computed from
    one element of it, read by a strided `reduce_window`, which XLA on CPU
    does not fuse with the elementwise loop that produces `update` (a slice
    would be fused, and that loop duplicated to produce one element). For a
    small 1-D `update` (a bias of 64 entries; not one of 4096) XLA rewrites
    the `reduce_window` and duplicates the loop all the same: the dependency
    is lost and XLA copies the small buffer it guarded."""
    dtype = update.dtype
    if jnp.issubdtype(dtype, jnp.inexact):
        width = jnp.finfo(dtype).bits  # of the real part for complex dtypes
    elif jnp.issubdtype(dtype, jnp.integer):
        width = jnp.iinfo(dtype).bits
    else:
        return None
    if update.size == 0 or width not in (8, 16, 32, 64):
        return None
    if not is_local(update):
        # One element of a sharded array lives on one device: reading it
        # would cost a collective on every emitting step.
        return None
    # The flag is a bool: no gradient flows through it (and none can be
    # asked of the bit cast below).
    x = lax.stop_gradient(update)
    if x.ndim:
        x = lax.reduce_window(
            x, jnp.zeros((), dtype), lax.add, (1,) * x.ndim, x.shape, "VALID"
        ).reshape(())
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.real(x)
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
    return (bits | 1) != 0  # true for every value, NaN included


def _after(
    updates: PyTree,
    new_state: PyTree,
    readers: list[tuple[int, ...] | None],
    flags: dict[int, jax.Array | None],
) -> PyTree:
    """`new_state`, each leaf that `readers` names given a data dependency on
    the updates that read its old value: `where(true, new, 0)` with a `true`
    computed from them, so XLA orders the reads before the write. `flags`
    holds the flag of each update leaf already computed, by index, and is
    filled in."""
    update_leaves = jax.tree.leaves(updates)
    leaves, treedef = jax.tree.flatten(new_state)
    out = []
    for leaf, reads in zip(leaves, readers, strict=True):
        if (
            reads
            and jnp.size(leaf)
            and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        ):
            preds = []
            for j in reads:
                if j not in flags:
                    flags[j] = _always_true(update_leaves[j])
                if flags[j] is not None:
                    preds.append(flags[j])
            if preds:
                pred = functools.reduce(jnp.logical_and, preds)
                leaf = cast_like(jnp.where(pred, leaf, jnp.zeros_like(leaf)), leaf)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


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
