"""Ordering a write after reads, so that XLA writes it in place.

XLA keeps a new value in its input's donated buffer only where every read of
the old value comes first; where another loop reads the old value, nothing
orders the two and XLA copies the buffer. A *token* (`read_token`) is a
scalar `True` computed from one element of each array that must be read
first; a write made to depend on it (`select_on`) comes after those reads.
`order_state_writes` and `outputs_before_clear` decide what to order in
`update_if`; `docs/design.md` ("Ordering tokens") says why each form is as
it is.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from ._leaves import is_typed_key
from ._sharding import (
    cast_varying,
    element_readable,
    read_replicated,
    surely_replicated,
    varying_axes,
)
from ._tree import cast_like

# How many reads a token tests in one vector (one kernel on XLA:CPU).
_READS_PER_KERNEL = 8


def bit_width(dtype: Any) -> int | None:
    """The width of one (real) element of `dtype`, where a bit cast to an
    unsigned integer exists; `None` elsewhere (bool, int4, ...)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        width = jnp.finfo(dtype).bits  # of the real part for complex dtypes
    elif jnp.issubdtype(dtype, jnp.integer):
        width = jnp.iinfo(dtype).bits
    else:
        return None
    return width if width in (8, 16, 32, 64) else None


def readable(x: jax.Array) -> bool:
    """Whether a token can read an element of `x`: not empty, a dtype with
    a bit cast, and an element this device can read (`_sharding`)."""
    return jnp.size(x) > 0 and bit_width(x.dtype) is not None and element_readable(x)


def orderable(leaf: Any) -> bool:
    """Whether a state leaf of this aval that the updates read is ordered
    after them: not a scalar (a copy costs less than the reads), not a key."""
    return math.prod(leaf.shape) > 1 and not is_typed_key(leaf)


def _first_bits(x: jax.Array) -> jax.Array:
    """The bits of the first element of `x` (of its real part if complex),
    as a `uint32[1]`."""
    first = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), (1,))
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = lax.real(first)
    bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{bit_width(first.dtype)}"))
    return lax.convert_element_type(bits, jnp.uint32)


def _always_true(v: jax.Array) -> jax.Array:
    """`v | 1 != 0` elementwise: true for every bit pattern, yet not
    something XLA can fold, so the reads of `v` are kept."""
    return lax.ne(lax.bitwise_or(v, lax.full_like(v, 1)), lax.full_like(v, 0))


def _all_true_of(bits: list[jax.Array]) -> jax.Array:
    """A `uint32[1]` 1 computed from the `uint32[1]` vectors `bits`."""
    v = lax.concatenate(bits, 0) if len(bits) > 1 else bits[0]
    ones = _always_true(v)
    return lax.convert_element_type(
        lax.reshape(lax.reduce_and(ones, (0,)), (1,)), jnp.uint32
    )


def _true_after_reading(arrays: list[jax.Array]) -> jax.Array:
    """A scalar `True` read from one element of each of `arrays`: tested
    `_READS_PER_KERNEL` at a time, then the results likewise until one is
    left (a tree of small kernels, compiled in linear time)."""
    bits = [_first_bits(a) for a in arrays]
    while True:  # at least once: the raw bits may be 0
        bits = [
            _all_true_of(bits[k : k + _READS_PER_KERNEL])
            for k in range(0, len(bits), _READS_PER_KERNEL)
        ]
        if len(bits) == 1:
            break
    (bit,) = bits
    return lax.ne(lax.reshape(bit, ()), lax.full((), 0, bit.dtype))


def opaque_true(leaves: list[Any]) -> jax.Array | None:
    """A scalar `True` that XLA cannot compute at compile time, read from the
    first element of the first array of `leaves` that every device holds
    whole and alike; `None` where there is none."""
    for x in leaves:
        if (
            isinstance(x, jax.Array)
            and readable(x)
            and not varying_axes(x)
            and surely_replicated(x)
        ):
            return lax.reshape(_always_true(_first_bits(x)), ())
    return None


def read_token(arrays: list[jax.Array], pred: jax.Array) -> jax.Array | None:
    """A scalar `True` that XLA cannot compute before every array of
    `arrays` is: one element of each is read inside one `lax.cond` on
    `pred` (a traced `True`). A fusion cannot reach into a conditional, so
    the loops that produce the arrays run, whole, before it. An element of
    an array sharded over several devices comes from the device holding it
    (`read_replicated`: a scalar all-reduce, in the running branch only).
    `None` when no array can be read."""
    arrays = [lax.stop_gradient(a) for a in arrays if readable(a)]
    if not arrays:
        return None

    def read(pred, arrays):
        return lax.bitwise_and(pred, read_replicated(_true_after_reading, arrays))

    # Inside `jax.shard_map`, `read` varies over every axis that an array
    # read (or `pred`) varies over; the other branch must be typed alike.
    axes = tuple(
        sorted(frozenset().union(*(varying_axes(x) or () for x in [pred, *arrays])))
    )

    def never(pred, arrays):
        false = lax.full((), False, jnp.bool_)
        return cast_varying(false, axes) if axes else false

    return lax.cond(pred, read, never, pred, arrays)


def select_on(token: jax.Array, value: jax.Array, other: jax.Array) -> jax.Array:
    """`where(token, value, other)`, computed after `token`, typed as `value`
    is. Inside `jax.shard_map`, a token that varies over an axis `value` does
    not would make the result vary there: `value` comes back unordered."""
    if not set(varying_axes(token) or ()) <= set(varying_axes(value) or ()):
        return value
    return cast_like(lax.select(token, value, other), value)


def zeros_in_place(grads: PyTree, token: jax.Array | None) -> PyTree:
    """Zeros shaped like `grads`, each computed as `where(token, 0, g)`:
    elementwise from `g`, so XLA may write it over `g`, after the reads that
    `token` follows. Without a token the values are zeros all the same."""
    if token is None:
        return jax.tree.map(jnp.zeros_like, grads)
    # `full_like` keeps `g`'s type, so `select_on` judges by `g`.
    return jax.tree.map(lambda g: select_on(token, lax.full_like(g, 0), g), grads)


def order_state_writes(
    update_leaves: list[jax.Array],
    state_leaves: list[jax.Array],
    readers: list[tuple[int, ...] | None],
    pred: jax.Array,
) -> tuple[list[jax.Array], set[int], set[int]]:
    """`state_leaves`, each `orderable` leaf that `readers` names made
    `where(token, new, 0)` with one token read after all the updates that
    read its old value, so XLA may write the new value in place. Also
    returns the indices of the leaves ordered and of the updates they
    follow."""
    needs = [
        i
        for i, (leaf, reads) in enumerate(zip(state_leaves, readers, strict=True))
        if reads and orderable(leaf)
    ]
    if not needs:
        return list(state_leaves), set(), set()
    read = sorted({j for i in needs for j in readers[i] or ()})
    token = read_token([update_leaves[j] for j in read], pred)
    if token is None:
        return list(state_leaves), set(), set()
    out = list(state_leaves)
    for i in needs:
        out[i] = select_on(token, out[i], lax.full_like(out[i], 0))
    return out, set(needs), set(read)


def outputs_before_clear(
    grad_readers: list[int],
    state_leaves: list[jax.Array],
    ordered: set[int],
    followed: set[int],
    n_updates: int,
    pred: jax.Array,
) -> list[int]:
    """Which outputs (updates, then state) the accumulator's clear is
    ordered after: `grad_readers`, less the updates that a readable state
    leaf among them was ordered after by `order_state_writes` (reading that
    leaf comes after them). A state leaf read here that no select of this
    level computes (one a nested conditional returns) is replaced in
    `state_leaves` by `select(pred, leaf, 0)`, so XLA does not copy it."""
    to_read, reading = grad_readers, set(grad_readers)
    if any(n_updates + i in reading and readable(state_leaves[i]) for i in ordered):
        to_read = [i for i in grad_readers if i not in followed]
    for i in to_read:
        j = i - n_updates
        if j >= 0 and j not in ordered and readable(state_leaves[j]):
            leaf = state_leaves[j]
            zero = lax.full_like(leaf, 0)
            state_leaves[j] = cast_like(lax.select(pred, leaf, zero), leaf)
    return to_read
