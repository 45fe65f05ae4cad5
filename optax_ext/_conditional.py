"""Running an inner optimizer on some steps only, by one `lax.cond`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from ._sharding import (
    aval_varying_axes,
    cast_varying,
    element_readable,
    read_replicated,
    sharded_type,
    surely_replicated,
    varying_axes,
    zeros_like_struct,
)
from ._tree import cast_like, check_same_shapes, is_typed_key


def update_if(
    pred: jax.Array,
    inner_update: Callable[..., tuple[PyTree, PyTree]],
    grads: PyTree,
    inner_state: PyTree,
    *,
    clear_grads: bool = False,
    carry: PyTree = None,
    index_by_live: bool = False,
) -> tuple[PyTree, PyTree, PyTree | None]:
    """`inner_update(grads, inner_state)` where `pred`, else zero updates and
    `inner_state` as it came in. With `index_by_live`, `pred` is computed
    from the caller's state (`MultiSteps`' counters), so it is batched
    wherever the state is.

    The zeros have the dtypes of the inner optimizer's updates (not of
    `grads`), and the new state is conformed to the old one's avals, so both
    branches of the `cond` agree exactly and the caller's state never changes
    type. Under `vmap` with a batched `pred` the `cond` becomes a select.

    `inner_update` is traced once: its jaxpr is analysed, then evaluated in
    the running branch (nesting `update_if` does not multiply traces).

    With `carry` (the params of a fused train step), `inner_update` is
    called as `inner_update(grads, inner_state, carry)` and returns the new
    carry in place of updates; where `pred` is false the carry comes back
    as it went in (no zero updates are built), and the new one is conformed
    to its avals.

    With `clear_grads`, the third output is `grads` cleared to zeros where
    `pred` (the inner update ran) and `grads` as they came in elsewhere; it is
    `None` otherwise. The zeros are ordered after every output that reads
    `grads`, so XLA may write them over `grads` (an accumulator reset in its
    own buffer). A state leaf whose old value the updates read directly
    (Lion's `mu`) is likewise ordered after those updates, so its new value
    may be written over the old one. Both orderings read one element of
    each array they follow, in one small conditional (`_token_after`): O(leaves)
    compiled ops (see `docs/design.md`).
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
        # `jit` would run `step` again in the branch (once more per level
        # when nested): evaluate the jaxpr traced here instead.
        closed, (out_shapes, state_shapes) = jax.make_jaxpr(step, return_shape=True)(
            *operands
        )
        n_consts = 0  # closed-over values are the jaxpr's consts
        call = lambda *args: jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))  # noqa: E731
    else:
        # Traced once here, for the analysis below; called in the running
        # branch, where the same avals find this trace in `jit`'s cache.
        # Inlined there (its equations copied into the branch): as a nested
        # call, XLA scheduled fused Adafactor in bfloat16 one pass over all
        # leaves at a time, with 1.4 times the temporary memory and at half
        # the speed (see docs/design.md).
        call = jax.jit(step, inline=True)
        traced = call.trace(*operands)
        closed = traced.jaxpr
        out_shapes, state_shapes = traced.out_info
        # Values `step` closes over (tracers of the caller) lead the invars.
        n_consts = len(closed.jaxpr.invars) - len(jax.tree.leaves(operands))
    n_grads = len(jax.tree.leaves(grads))
    n_state = len(jax.tree.leaves(inner_state))
    n_updates = len(jax.tree.leaves(out_shapes))
    readers = _updates_reading_old_state(
        closed.jaxpr,
        n_grads=n_grads,
        n_updates=n_updates,
        n_state=n_state,
        n_consts=n_consts,
    )
    grad_readers = _outputs_reading_grads(
        closed.jaxpr, n_grads=n_grads, n_consts=n_consts
    )
    out_def = jax.tree.structure((out_shapes, state_shapes))
    out_avals = closed.out_avals

    def run(live, grads, inner_state, carry):
        leaves = jax.tree.leaves(call(grads, inner_state, carry))
        # Evaluated eagerly, a constant output is a Python or NumPy value.
        leaves = [cast_like(x, a) for x, a in zip(leaves, out_avals, strict=True)]
        update_leaves = leaves[:n_updates]
        state_leaves, ordered, followed = _after(
            update_leaves, leaves[n_updates:], readers, live
        )
        if clear_grads:
            to_read = _clear_after(
                grad_readers, state_leaves, ordered, followed, n_updates, live
            )
        new_updates, new_inner_state = jax.tree.unflatten(
            out_def, [*update_leaves, *state_leaves]
        )
        if not clear_grads:
            return new_updates, new_inner_state, None
        outputs = [*update_leaves, *state_leaves]
        done = _token_after([outputs[i] for i in to_read], live)
        return new_updates, new_inner_state, _zeros_after(grads, done)

    def skip(live, grads, inner_state, carry):
        kept = carry
        if not carried:
            kept = _typed_like(_distinct_zeros(out_shapes, live), out_avals[:n_updates])
        return kept, inner_state, (grads if clear_grads else None)

    # `live` goes in as an operand: inside the running branch it is a
    # `True` that XLA cannot fold (see `_token_after`), even where `pred` is
    # a constant (`skip_when` called without `skip`), whose conditional XLA
    # inlines: there one element of an input is tested as well.
    live = pred
    runtime = _runtime_true(jax.tree.leaves((inner_state, grads)))
    if runtime is not None:
        live = lax.bitwise_and(pred, runtime)
    # Where a state leaf is ordered after the updates (Lion's `mu`), the
    # conditional itself must stay one: inlined, XLA fused the updates into
    # `apply_updates` past the token and copied the state.
    ordering = any(
        _orderable(aval) and reads
        for aval, reads in zip(out_avals[n_updates:], readers, strict=True)
    )
    # Indexed through `live`, XLA computes `live` and the index in one
    # kernel, where `pred` takes one more to convert. That is done where
    # `pred` varies with the state anyway (`index_by_live`): under `vmap`
    # with a batched state and an unbatched `pred` (a `skip_when` flag
    # shared by the batch), `live` is batched and the conditional would
    # become a select. A `pred` that XLA folds (`skip_when` called without
    # `skip`) indexes the conditional itself, which XLA then inlines.
    return lax.cond(
        live if ordering or index_by_live else pred,
        run,
        skip,
        live,
        grads,
        inner_state,
        carry,
    )


def _clear_after(
    grad_readers: list[int],
    state_leaves: list[jax.Array],
    ordered: set[int],
    followed: set[int],
    n_updates: int,
    live: jax.Array,
) -> list[int]:
    """Which outputs (updates, then state) the accumulator's clear is
    ordered after: `grad_readers`, less the updates that a readable state
    leaf among them was ordered after by `_after` (reading that leaf comes
    after them). A state leaf read here that no select of this level
    computes (one a nested conditional returns) is replaced in
    `state_leaves` by `select(live, leaf, 0)`: read by the token's
    conditional and returned as it was, XLA copied it."""
    to_read, reading = grad_readers, set(grad_readers)
    if any(n_updates + i in reading and _readable(state_leaves[i]) for i in ordered):
        to_read = [i for i in grad_readers if i not in followed]
    for i in to_read:
        j = i - n_updates
        if j >= 0 and j not in ordered and _readable(state_leaves[j]):
            leaf = state_leaves[j]
            zero = lax.full_like(leaf, 0)
            state_leaves[j] = cast_like(lax.select(live, leaf, zero), leaf)
    return to_read


def _runtime_true(leaves: list[Any]) -> jax.Array | None:
    """A scalar `True` that XLA cannot compute at compile time: a test that
    holds for every bit pattern of the first element of the first readable
    array of `leaves` that is the same on every device (inside
    `jax.shard_map`, a value varying over an axis would make `live` vary,
    and the token's branches disagree in type) and known to be whole on
    each (outside `shard_map`, an element of a sharded array would be sent
    by a collective on every call); `None` where there is none."""
    for x in leaves:
        if (
            isinstance(x, jax.Array)
            and _readable(x)
            and not varying_axes(x)
            and surely_replicated(x)
        ):
            return lax.reshape(_holds_for_any_bits(_first_bits(x)), ())
    return None


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


def _distinct_zeros(structs: PyTree, live: jax.Array) -> PyTree:
    """Zeros shaped like `structs`, no two large leaves the same computation.

    Zeros of one shape are one broadcast to XLA, which then copies it into
    each output of the `cond` that holds it (a read and a write per leaf).
    Here a leaf `i` of at least `DISTINCT_ZEROS_MIN_SIZE` elements broadcasts
    its own scalar, `where(live, tag_i, 0)`, with `live` a traced `False`
    and `tag_i` the bits of `i + 1`: nothing to merge, and it is written
    once, straight into its output."""
    leaves, treedef = jax.tree.flatten(structs)
    return jax.tree.unflatten(
        treedef, [_tagged_zeros(s, i, live) for i, s in enumerate(leaves)]
    )


def _tagged_zeros(struct: Any, i: int, live: jax.Array) -> jax.Array:
    dtype = jnp.dtype(struct.dtype)
    width = _bits(dtype)
    small = math.prod(struct.shape) < DISTINCT_ZEROS_MIN_SIZE
    if width is None or small:
        return zeros_like_struct(struct)
    real = jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else dtype
    bits = jnp.asarray((i + 1) % 2**width, jnp.dtype(f"uint{width}"))
    tag = lax.convert_element_type(lax.bitcast_convert_type(bits, real), dtype)
    fill = lax.select(live, tag, lax.full((), 0, dtype))
    if sharded_type(struct):  # `Explicit` axes: the sharding is in the type
        return lax.full(struct.shape, fill, dtype, sharding=struct.sharding)
    return lax.broadcast(fill, struct.shape)


def _outputs_reading_grads(jaxpr: Any, *, n_grads: int, n_consts: int = 0) -> list[int]:
    """Indices of the outputs (updates, then new state) of `step`'s jaxpr
    whose value depends on the `n_grads` inputs after the first `n_consts`
    (the gradients after the values `step` closes over), leaving out those that
    another such output depends on (Adam's new moments, which its updates
    read): an output computed after them is computed after their reads of
    the inputs too. The analysis looks into calls and conditionals
    (`_flow`); other equations with inner jaxprs pass every input's
    dependency to every output, which can only add outputs."""
    n_in = len(jaxpr.invars)
    grads_bit = [0] * n_consts + [1] * n_grads + [0] * (n_in - n_consts - n_grads)
    reading = _flow(jaxpr, grads_bit, {})
    readers = [i for i, m in enumerate(reading) if m]
    # Which outputs each output is computed from, one bit per output: the
    # users of output `i` see its bit.
    position: dict[Any, tuple[int, int]] = {}
    for i, v in enumerate(jaxpr.outvars):
        if isinstance(v, jex_core.Var):
            position[v] = (0, position.get(v, (0, 0))[1] | 1 << i)
    upstream = _flow(jaxpr, [0] * n_in, position)
    behind = 0
    for i in readers:
        behind |= upstream[i]
    return [i for i in readers if not behind >> i & 1]


# Primitives that call one inner jaxpr on their operands, one to one (for
# custom_jvp/vjp calls, the primal function).
_CALLS = (
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "remat",
    "remat2",
    "checkpoint",
)
_CALL_PARAMS = ("jaxpr", "call_jaxpr")


def _flow(
    jaxpr: Any, in_masks: list[int], adjust: dict[Any, tuple[int, int]]
) -> list[int]:
    """A forward pass of bit masks over `jaxpr`: each input starts with its
    mask, each equation's outputs get the union of the masks of the inputs
    they depend on, and the masks of the outputs come back.

    `adjust` maps a variable to `(clear, set)`: where an equation defines
    it, its users see its mask less `clear` and with `set` (the mask
    returned for an output of the jaxpr is the one before). Calls and
    `cond` are looked into: each output of a conditional depends on what it
    depends on in some branch and on its index (less the bits that the
    conditional's own outputs clear: those leaves are written after the
    index is read), and an adjusted output is adjusted where its branch
    defines it. Any other equation with inner jaxprs (loops) passes every
    input's mask to every output."""
    env: dict[Any, int] = {}
    defined: dict[Any, int] = {}

    def of(v: Any) -> int:
        return 0 if isinstance(v, jex_core.Literal) else env.get(v, 0)

    def define(v: Any, mask: int) -> None:
        defined[v] = mask
        clear, set_ = adjust.get(v, (0, 0))
        env[v] = (mask & ~clear) | set_

    for v, mask in zip(jaxpr.invars, in_masks, strict=True):
        define(v, mask)
    for eqn in jaxpr.eqns:
        masks = _eqn_flow(eqn, [of(v) for v in eqn.invars], adjust)
        for v, mask in zip(eqn.outvars, masks, strict=True):
            define(v, mask)
    return [
        0 if isinstance(v, jex_core.Literal) else defined.get(v, 0)
        for v in jaxpr.outvars
    ]


def _eqn_flow(
    eqn: Any, masks: list[int], adjust: dict[Any, tuple[int, int]]
) -> list[int]:
    """The masks of `eqn`'s outputs (see `_flow`)."""
    name = eqn.primitive.name
    if name == "cond":
        # The index is read before either branch runs: a leaf whose new
        # value this conditional returns (its bit in `adjust`'s clear) is
        # written after that read. Every other bit of the index reaches
        # every output: a write outside must still follow the read.
        index, *operands = masks
        written = 0
        for v in eqn.outvars:
            written |= adjust.get(v, (0, 0))[0]
        out = [index & ~written] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            got = _flow(
                branch.jaxpr, operands, _inner_adjust(branch.jaxpr, eqn, adjust)
            )
            out = [a | b for a, b in zip(out, got, strict=True)]
        return out
    if name in _CALLS:
        for key in _CALL_PARAMS:
            inner = eqn.params.get(key)
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
            if (
                isinstance(inner, jex_core.Jaxpr)
                and len(inner.invars) == len(masks)
                and len(inner.outvars) == len(eqn.outvars)
            ):
                return _flow(inner, masks, _inner_adjust(inner, eqn, adjust))
    union = 0
    for mask in masks:
        union |= mask
    return [union] * len(eqn.outvars)


def _inner_adjust(
    inner: Any, eqn: Any, adjust: dict[Any, tuple[int, int]]
) -> dict[Any, tuple[int, int]]:
    """`adjust` of `eqn`'s outputs, moved onto the inner jaxpr's variables
    that define them. An inner output that is an inner input (returned as
    it came in) is left alone: its other users inside read the input."""
    inputs = set(inner.invars)
    moved: dict[Any, tuple[int, int]] = {}
    for v, out in zip(inner.outvars, eqn.outvars, strict=True):
        if out in adjust and isinstance(v, jex_core.Var) and v not in inputs:
            clear, set_ = moved.get(v, (0, 0))
            c, s = adjust[out]
            moved[v] = (clear | c, set_ | s)
    return moved


def _token_after(arrays: list[jax.Array], live: jax.Array) -> jax.Array | None:
    """A scalar `True` that XLA cannot compute before every array of
    `arrays` is: one element of each is read inside one `lax.cond` on
    `live` (a traced `True`), which XLA compiles as a conditional. A fusion
    cannot reach into a conditional, so the loops that produce the arrays
    run, whole, before it, and every consumer reads its one scalar:
    O(len(arrays)) compiled ops in a few small kernels. (An
    element read in the open is fused into the loop that produces the
    array, which XLA then duplicates to compute that one element: no order.)
    Outside `shard_map`, an element of an array sharded over several devices
    comes from the device holding it (`read_replicated`): a scalar
    all-reduce per set of mesh axes that the arrays are sharded over, in the
    branch that runs the inner optimizer. `None` when no
    array can be read: empty, not numeric, or inside `shard_map` over some
    mesh axes only."""
    arrays = [lax.stop_gradient(a) for a in arrays if _readable(a)]
    if not arrays:
        return None

    def read(live, arrays):
        bit = read_replicated(_one_bit, arrays)
        return lax.bitwise_and(live, bit)

    # Inside `jax.shard_map`, `read` varies over every axis that an array
    # read (or `live`) varies over; the other branch must be typed alike.
    axes = tuple(
        sorted(frozenset().union(*(varying_axes(x) or () for x in [live, *arrays])))
    )

    def never(live, arrays):
        false = lax.full((), False, jnp.bool_)
        return cast_varying(false, axes) if axes else false

    return lax.cond(live, read, never, live, arrays)


def _select_after(token: jax.Array, value: jax.Array, other: jax.Array) -> jax.Array:
    """`where(token, value, other)`, computed after `token` (see
    `_token_after`), typed as `value` is. Inside `jax.shard_map`, a token
    that varies over an axis `value` does not (one device's element read)
    would make the result vary there, and the conditional's branches
    disagree: `value` is returned as it is, unordered (XLA may copy it)."""
    if not set(varying_axes(token) or ()) <= set(varying_axes(value) or ()):
        return value
    return cast_like(lax.select(token, value, other), value)


def _one_bit(arrays: list[jax.Array]) -> jax.Array:
    """A scalar `True` read from one element of each of `arrays`, as bits,
    tested in vectors of `_READS_PER_KERNEL` (a concatenate, a test that is
    always true, a reduction), then the same over the results until one is
    left: a tree of small kernels (XLA:CPU merges a few, up to 40 reads
    each). A chain of one `and` per array fused into one kernel with every
    read, which XLA took quadratic time to build and compile."""
    bits = [_first_bits(a) for a in arrays]
    while True:  # at least once: the raw bits may be 0
        bits = [
            _all_set(bits[k : k + _READS_PER_KERNEL])
            for k in range(0, len(bits), _READS_PER_KERNEL)
        ]
        if len(bits) == 1:
            break
    (bit,) = bits
    return lax.ne(lax.reshape(bit, ()), lax.full((), 0, bit.dtype))


# How many reads `_token_after` concatenates at once: XLA:CPU fuses a
# concatenate of up to 8 operands with the reads that produce them; a longer
# one makes each read a kernel and a buffer of its own.
_READS_PER_KERNEL = 8


def _all_set(bits: list[jax.Array]) -> jax.Array:
    """`uint32[1]` 1 from `uint32[1]` vectors: a test on each bit pattern
    that is true for every one (`x | 1 != 0`), which XLA cannot fold, so it
    keeps the reads."""
    v = lax.concatenate(bits, 0) if len(bits) > 1 else bits[0]
    ones = _holds_for_any_bits(v)
    return lax.convert_element_type(
        lax.reshape(lax.reduce_and(ones, (0,)), (1,)), jnp.uint32
    )


def _holds_for_any_bits(v: jax.Array) -> jax.Array:
    """`v | 1 != 0` elementwise: true for every bit pattern, yet not
    something XLA can fold, so the reads of `v` are kept."""
    return lax.ne(lax.bitwise_or(v, lax.full_like(v, 1)), lax.full_like(v, 0))


def _first_bits(x: jax.Array) -> jax.Array:
    """The bits of the first element of `x` (of its real part if complex),
    as a `uint32[1]`, computed so that XLA cannot fold them: the read of `x`
    is kept."""
    first = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), (1,))
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = lax.real(first)
    bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{_bits(first.dtype)}"))
    return lax.convert_element_type(bits, jnp.uint32)


def _bits(dtype: Any) -> int | None:
    """The width of one (real) element of `dtype`, where a bit cast to an
    unsigned integer exists; `None` elsewhere (bool, int4, ...)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        width = jnp.finfo(dtype).bits  # of the real part for complex dtypes
    elif jnp.issubdtype(dtype, jnp.integer):
        width = jnp.iinfo(dtype).bits
    else:
        return None
    return width if width in (8, 16, 32, 64) else None


def _readable(x: jax.Array) -> bool:
    return jnp.size(x) > 0 and _bits(x.dtype) is not None and element_readable(x)


def _zeros_after(grads: PyTree, done: jax.Array | None) -> PyTree:
    """Zeros shaped like `grads`, each computed as `where(done, 0, g)`:
    elementwise from `g`, so XLA may write it over `g`, and after `done` is,
    so after the reads of `g` that `done` follows. Without `done` XLA orders
    nothing and copies; the values are zeros all the same."""
    if done is None:
        return jax.tree.map(jnp.zeros_like, grads)
    # `full_like` keeps `g`'s type, so `_select_after` judges by `g`.
    return jax.tree.map(lambda g: _select_after(done, lax.full_like(g, 0), g), grads)


def _updates_reading_old_state(
    jaxpr: Any,
    *,
    n_grads: int,
    n_updates: int,
    n_state: int | None = None,
    n_consts: int = 0,
) -> list[tuple[int, ...] | None]:
    """For each state leaf of `step`'s jaxpr: the indices of the update leaves
    that depend on its old value other than through its new value, or `None`
    where the leaf is returned as it came in (nothing is written over it).

    A forward pass (`_flow`) with one bit per state leaf; the bit of leaf
    `i` is not passed on by the variable that is its new value, also where a
    call or a conditional inside defines it. Only reads by the updates are
    found: a leaf whose old value only another leaf's new value reads is
    left to XLA (which copies where it cannot order them).
    """
    first = n_consts + n_grads  # the invars: closed-over values, grads, state
    end = None if n_state is None else first + n_state
    state_in = jaxpr.invars[first:end]
    new_state = jaxpr.outvars[n_updates:]
    in_masks = [0] * len(jaxpr.invars)
    for i in range(len(state_in)):
        in_masks[first + i] |= 1 << i
    inputs = set(jaxpr.invars)
    blocked: dict[Any, tuple[int, int]] = {}
    for i, v in enumerate(new_state):
        if isinstance(v, jex_core.Var) and v not in inputs:
            blocked[v] = (blocked.get(v, (0, 0))[0] | (1 << i), 0)
    update_bits = _flow(jaxpr, in_masks, blocked)[:n_updates]
    # Which updates each new state leaf is computed from (a nested
    # `update_if` has ordered it after them already): those need nothing.
    marks: dict[Any, tuple[int, int]] = {}
    for j, v in enumerate(jaxpr.outvars[:n_updates]):
        if isinstance(v, jex_core.Var) and v not in inputs:
            marks[v] = (0, marks.get(v, (0, 0))[1] | (1 << j))
    after = _flow(jaxpr, [0] * len(jaxpr.invars), marks)[n_updates:]
    # Invert update -> state bits by their set bits only (not every pair of
    # leaves: that loop alone was quadratic in the leaves).
    read_by: list[list[int]] = [[] for _ in state_in]
    for j, b in enumerate(update_bits):
        while b:
            low = b & -b
            i = low.bit_length() - 1
            if not after[i] >> j & 1:
                read_by[i].append(j)
            b ^= low
    return [
        None if new is old else tuple(read_by[i])
        for i, (old, new) in enumerate(zip(state_in, new_state, strict=True))
    ]


def _after(
    update_leaves: list[jax.Array],
    state_leaves: list[jax.Array],
    readers: list[tuple[int, ...] | None],
    live: jax.Array,
) -> tuple[list[jax.Array], set[int], set[int]]:
    """`state_leaves`, each leaf that `readers` names given a data dependency
    on the updates that read its old value: `where(token, new, 0)` with one
    `token` computed after all those updates (`_token_after`), so XLA orders
    the reads before the write and may write the new value in place. The
    select fuses into the loop that computes the new value. A scalar (a step
    count that every update reads through a schedule) is left to XLA, which
    copies it: one scalar copy costs less than reading every update leaf
    first. Any larger leaf is ordered, small ones too: XLA puts the copy of
    an unordered leaf in the branch that does not run, on every mini-step.

    Also returns the indices of the leaves ordered and of the updates they
    follow: reading one of those leaves comes after those updates."""
    needs = [
        i
        for i, (leaf, reads) in enumerate(zip(state_leaves, readers, strict=True))
        if reads and _orderable(leaf)
    ]
    if not needs:
        return list(state_leaves), set(), set()
    read = sorted({j for i in needs for j in readers[i] or ()})
    token = _token_after([update_leaves[j] for j in read], live)
    if token is None:
        return list(state_leaves), set(), set()
    out = list(state_leaves)
    for i in needs:
        leaf = out[i]
        out[i] = _select_after(token, leaf, lax.full_like(leaf, 0))
    return out, set(needs), set(read)


def _orderable(leaf: Any) -> bool:
    """Whether `_after` orders a state leaf of this aval that the updates
    read: not a scalar, not a key."""
    return math.prod(leaf.shape) > 1 and not is_typed_key(leaf)


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
