"""Running an inner optimizer on some steps only, in one `lax.cond` that
XLA keeps as written on every backend.

`update_if` runs `inner_update` where `pred` holds; elsewhere the inner
state (and, fused, the params) pass through the other branch untouched, or
it returns zeros of the updates' types. The running branch opens with an
optimization barrier so that no backend turns the conditional into
selects, and nothing computed before the conditional is routed through it
(`docs/design.md`, "The plain form").
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

from .._leaves import is_typed_key
from .._sharding import (
    aval_varying_axes,
    cast_varying,
    sharded_type,
    typed_sharding,
    varying_axes,
)
from .._tree import cast_like, check_same_shapes


def _trace_once(step: Callable, operands: tuple) -> tuple[Callable, Any, Any]:
    """`step` as a function to call in the running branch, traced once
    here: the caller's `jit` cache holds the trace (`inline` copies its
    equations into the branch), so nesting `update_if` does not multiply
    traces. Returns the call, the outputs' tree and the closed jaxpr."""
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        # `jit` would run `step` again in the branch, once more per level.
        closed, shapes = jax.make_jaxpr(step, return_shape=True)(*operands)
        return (
            lambda *args: jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args)),
            jax.tree.structure(shapes),
            closed,
        )
    call = jax.jit(step, inline=True)
    traced = call.trace(*operands)
    return call, jax.tree.structure(traced.out_info), traced.jaxpr


def update_if(
    pred: jax.Array,
    inner_update: Callable[..., tuple[PyTree, PyTree]],
    operands: tuple,
    inner_state: PyTree,
    *,
    carry: PyTree = None,
    counter: tuple[jax.Array, jax.Array] | None = None,
    selected_on: Callable[[str], bool] | None = None,
) -> tuple[PyTree, PyTree, jax.Array | None]:
    """`inner_update(*operands, inner_state)` where `pred`, else zero
    updates and `inner_state` as it came in.

    The zeros have the dtypes of the inner optimizer's updates, and the new
    state is conformed to the old one's avals, so both branches agree
    exactly and the caller's state never changes type. Under `vmap` with a
    batched `pred` the `cond` becomes a select. `inner_update` is traced
    once.

    With `carry` (the params of a fused train step), `inner_update` is
    called as `inner_update(*operands, inner_state, carry)` and returns the
    new carry in place of updates; where `pred` is false the carry comes
    back as it went in.

    With `counter`, a pair `(ran, kept)` of int32 scalars, the third output
    is `ran` where the inner update ran and `kept` elsewhere, computed in
    the branches (out of the running branch's barrier): a caller that
    reads it (whether a `MultiSteps` window emitted) keeps the barrier,
    and so the conditional, alive in XLA. `None` otherwise.

    With `selected_on`, a function of the platform (`"cpu"`, `"cuda"`,
    `"rocm"`, `"tpu"`) that the program is lowered for: where it is true
    there is no conditional, `inner_update` runs on every call and its
    results are selected by `pred` (traced once for both forms).
    """
    carried = carry is not None
    returns_count = counter is not None
    known = known_bool(pred)
    if known is not None and counter is None:
        # Decided while tracing: no conditional (nor barrier) at all.
        return (*_decided(known, inner_update, operands, inner_state, carry), None)
    if counter is None:
        counter = (jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32))
    ran, kept = counter

    def step(operands, inner_state, carry):
        if carried:
            new_carry, new_state = inner_update(*operands, inner_state, carry)
            new_carry = conform_state(new_carry, carry)
        else:
            new_carry, new_state = inner_update(*operands, inner_state)
        return new_carry, conform_state(new_state, inner_state)

    call, out_def, closed = _trace_once(step, (operands, inner_state, carry))
    out_avals = closed.out_avals
    n_state = len(jax.tree.leaves(inner_state))
    n_updates = len(out_avals) - n_state
    # Inputs before the inner state: the values `step` closes over, then
    # the operands.
    first_state = len(closed.jaxpr.invars) - n_state - len(jax.tree.leaves(carry))
    to_order = old_value_read_first(closed.jaxpr, first_state, n_state, n_updates)

    def run(operands, inner_state, carry, seed):
        # Not a cheap op: XLA:GPU turns a two-branch conditional whose ops
        # are all cheap (an optimizer's elementwise arithmetic) into
        # selects. On the scalars alone (the counters, a step count): around
        # the arrays it kept XLA's partitioner from carrying their sharding
        # into the branch (params sharded under `jit` were all-gathered).
        (operands, inner_state), count = _scalar_barrier((operands, inner_state), ran)
        leaves = jax.tree.leaves(call(operands, inner_state, carry))
        # Evaluated eagerly, a constant output is a Python or NumPy value.
        leaves = [cast_like(x, a) for x, a in zip(leaves, out_avals, strict=True)]
        leaves = _state_after_updates(leaves, n_updates, to_order)
        return jax.tree.unflatten(out_def, leaves), count

    def skip(operands, inner_state, carry, seed):
        if carried:
            return (carry, inner_state), kept
        zeros = distinct_zeros(out_avals[:n_updates], seed)
        updates_def = out_def.children()[0]
        return (jax.tree.unflatten(updates_def, zeros), inner_state), kept

    def conditional():
        # The zeros' seed: any int32 scalar XLA cannot fold.
        seed = lax.convert_element_type(pred, jnp.int32)
        (result, new_state), count = lax.cond(
            pred, run, skip, operands, inner_state, carry, seed
        )
        return result, new_state, count

    def selected():
        leaves = jax.tree.leaves(call(fold_apart(operands), inner_state, carry))
        leaves = [cast_like(x, a) for x, a in zip(leaves, out_avals, strict=True)]
        result, new_state = jax.tree.unflatten(out_def, leaves)
        return (
            *select_results(pred, (result, new_state), (carry, inner_state), carried),
            jnp.where(pred, ran, kept),
        )

    result, new_state, count = _per_platform(selected_on, selected, conditional)
    return result, new_state, count if returns_count else None


def fold_apart(tree: PyTree) -> PyTree:
    """`tree` (the folded accumulator, before the drop-in's inner optimizer
    runs on every step) with each leaf of rank 0 or 1 behind an
    optimization barrier of its own, on TPUs only (docs/design.md)."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.ndim <= 1]
    if not at:
        return tree
    arrays = lax.platform_dependent(
        [leaves[i] for i in at],
        tpu=lambda xs: [lax.optimization_barrier(x) for x in xs],
        default=lambda xs: xs,
    )
    for i, x in zip(at, arrays, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _decided(
    known: bool, inner_update: Callable, operands: tuple, inner_state: PyTree, carry
) -> tuple[PyTree, PyTree]:
    """`update_if` where `pred` is known while tracing: `inner_update`
    called, or zero updates (the carry) and the state as they came."""
    if not known and carry is not None:
        return carry, inner_state
    if not known:
        return _zeros_of(inner_update, operands, inner_state), inner_state
    if carry is not None:
        new_carry, new_state = inner_update(*operands, inner_state, carry)
        return conform_state(new_carry, carry), conform_state(new_state, inner_state)
    new_updates, new_state = inner_update(*operands, inner_state)
    return new_updates, conform_state(new_state, inner_state)


def select_results(
    pred: jax.Array, new: tuple, old: tuple, carried: bool
) -> tuple[PyTree, PyTree]:
    """The new results (updates or carry) and state where `pred`, the old
    carry (or zero updates) and state elsewhere."""
    (result, new_state), (carry, inner_state) = new, old
    if carried:
        result = jax.tree.map(lambda n, o: jnp.where(pred, n, o), result, carry)
    else:
        result = jax.tree.map(lambda u: jnp.where(pred, u, 0).astype(u.dtype), result)
    new_state = jax.tree.map(lambda n, o: jnp.where(pred, n, o), new_state, inner_state)
    return result, new_state


def _per_platform(
    selected_on: Callable[[str], bool] | None,
    selected: Callable[[], Any],
    conditional: Callable[[], Any],
) -> Any:
    """`conditional()`, or `selected()` on the platforms `selected_on`
    names, chosen when the program is lowered; with jit disabled, for
    this backend."""
    if selected_on is None:
        return conditional()
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        # Run here, on this backend: no other to lower for.
        return selected() if selected_on(jax.default_backend()) else conditional()
    forms = {
        p: selected if selected_on(p) else conditional
        for p in ("cpu", "cuda", "rocm", "tpu")
    }
    return lax.platform_dependent(**forms, default=selected)


def known_bool(x: Any) -> bool | None:
    """`x` as a Python bool where it is known while tracing (a Python or
    NumPy bool, an array made outside the trace); `None` where traced."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _zeros_of(inner_update: Callable, operands: tuple, inner_state: PyTree) -> PyTree:
    """Zeros of the types of `inner_update`'s updates, without running it."""
    shapes, _ = jax.eval_shape(inner_update, *operands, inner_state)
    return jax.tree.map(lambda s: lax.full(s.shape, 0, s.dtype), shapes)


def _first_bits(x: jax.Array) -> jax.Array | None:
    """The bits of the first element of `x` as a uint32 scalar (of its real
    part if complex); `None` where `x` is empty or has no bit cast."""
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.number):
        return None
    first = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ())
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = lax.real(first)
    width = jnp.dtype(first.dtype).itemsize * 8
    if width not in (8, 16, 32, 64):
        return None
    bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{width}"))
    return lax.convert_element_type(bits, jnp.uint32)


def read_token(tree: PyTree) -> jax.Array | None:
    """A bool scalar, `True` whatever the values, that XLA computes after
    every array of `tree` (it reads one element of each) and cannot fold:
    what is selected by it is ordered after them. `None` where no leaf can
    be read (no number arrays, or one sharded in its type: `Explicit` axes
    or inside `shard_map`, where one element has no type)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if any(varying_axes(x) or typed_sharding(x) for x in leaves):
        return None
    bits = [b for b in map(_first_bits, leaves) if b is not None]
    if not bits:
        return None
    # `b | 1 != 0`: true for every value, yet not foldable by XLA; computed
    # once (a barrier), not inside each loop that selects by it.
    v = lax.concatenate([lax.reshape(b, (1,)) for b in bits], 0)
    ones = lax.ne(lax.bitwise_or(v, lax.full_like(v, 1)), lax.full_like(v, 0))
    return lax.optimization_barrier(lax.reduce_and(ones, (0,)))


def old_value_read_first(
    jaxpr: Any, first_state: int, n_state: int, n_updates: int
) -> list[bool]:
    """For each state output of the inner step's `jaxpr` (outputs: the
    updates, then the state; inputs from `first_state` on: the old state),
    whether the updates read the old value and not the new one (Lion's
    `mu`): the leaves `_state_after_updates` orders. An equation counts as
    reading all its inputs for all its outputs (a nested call too)."""
    needed = {v for v in jaxpr.outvars[:n_updates] if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed |= {v for v in eqn.invars if isinstance(v, jex_core.Var)}
    old = jaxpr.invars[first_state : first_state + n_state]
    new = jaxpr.outvars[n_updates:]
    return [
        o in needed and (not isinstance(n, jex_core.Var) or n not in needed)
        for o, n in zip(old, new, strict=True)
    ]


def _state_after_updates(
    leaves: list[Any], n_updates: int, to_order: list[bool]
) -> list[Any]:
    """On XLA:CPU, each new state array in `to_order` computed after every
    update (or new params) leaf: XLA:CPU computes them in loops of their
    own and, not knowing which comes first, copies a state leaf whose old
    value the updates read (Lion's `mu`) rather than overwrite it, in the
    running branch and, for the conditional's output, in the other; made to
    follow a value read from every update, it is written in place. Other
    backends compute both in one loop and need no order."""
    at = [i for i in range(n_updates) if isinstance(leaves[i], jax.Array)]
    ordered = [
        i
        for i in range(n_updates, len(leaves))
        if to_order[i - n_updates]
        and isinstance(leaves[i], jax.Array)
        and leaves[i].size > 1
        and not is_typed_key(leaves[i])
        and jnp.issubdtype(leaves[i].dtype, jnp.number)
    ]
    # Inside `shard_map`, or with a leaf sharded in its type (`Explicit`
    # axes, where one element has no type), no token: XLA may copy.
    unreadable = any(varying_axes(x) or typed_sharding(x) for x in leaves)
    if not at or not ordered or unreadable:
        return leaves

    def after(updates, state):
        # The updates returned are the barrier's: computed once, before.
        updates = lax.optimization_barrier(updates)
        token = read_token(updates)
        if token is None:
            return updates, state
        return updates, [lax.select(token, x, lax.full_like(x, 0)) for x in state]

    updates, state = lax.platform_dependent(
        [leaves[i] for i in at],
        [leaves[i] for i in ordered],
        cpu=after,
        default=lambda u, s: (u, s),
    )
    out = list(leaves)
    for i, x in zip([*at, *ordered], [*updates, *state], strict=True):
        out[i] = x
    return out


def _scalar_barrier(tree: PyTree, ran: jax.Array) -> tuple[PyTree, jax.Array]:
    """`tree` and `ran` with `ran` and every scalar leaf of `tree` passed
    through one `lax.optimization_barrier`, grouped by the mesh axes they
    vary over inside `jax.shard_map` (a barrier's outputs vary over all its
    inputs' axes)."""
    leaves, treedef = jax.tree.flatten(tree)
    scalars = [
        i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.ndim == 0
    ]
    groups: dict[frozenset, list[int]] = {}
    for i in scalars:
        groups.setdefault(varying_axes(leaves[i]) or frozenset(), []).append(i)
    out = list(leaves)
    ran_axes = varying_axes(ran) or frozenset()
    if ran_axes not in groups:
        ran = lax.optimization_barrier(ran)
    for axes, indices in groups.items():
        values = [leaves[i] for i in indices]
        if axes == ran_axes:
            *values, ran = lax.optimization_barrier([*values, ran])
        else:
            values = lax.optimization_barrier(values)
        for i, x in zip(indices, values, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out), ran


# Leaves from this many elements get zeros of their own (`distinct_zeros`);
# below it a copy of a shared broadcast costs less than one more kernel to
# launch and to compile.
DISTINCT_ZEROS_MIN_SIZE = 1 << 16


def distinct_zeros(avals: list[Any], seed: jax.Array | None) -> list[jax.Array]:
    """Zeros of `avals`, no two large ones one computation to XLA.

    Zeros of one shape are one broadcast to XLA, which then copies it into
    each output of the `cond` that holds it. Here leaf `i` of at least
    `DISTINCT_ZEROS_MIN_SIZE` elements broadcasts `float(seed + i) * 0`, a
    product XLA does not fold (it would not be 0 for an infinite factor),
    and exactly `+0` for the finite factor it is: nothing to merge, each
    written once, straight into its output. Without a traced `seed` plain
    zeros."""
    out = []
    for i, aval in enumerate(avals):
        dtype = jnp.dtype(aval.dtype)
        small = math.prod(aval.shape) < DISTINCT_ZEROS_MIN_SIZE
        if seed is None or small or not jnp.issubdtype(dtype, jnp.inexact):
            zero = lax.full((), 0, dtype)
        else:
            real = jnp.finfo(dtype).dtype  # the real part's dtype for complex
            factor = lax.convert_element_type(seed + i, real)
            zero = lax.convert_element_type(factor * lax.full((), 0, real), dtype)
        if sharded_type(aval):  # `Explicit` axes: the sharding is in the type
            z = lax.full(aval.shape, zero, dtype, sharding=aval.sharding)
        else:
            z = lax.broadcast(zero, aval.shape)
        # Inside `jax.shard_map` the running branch's outputs may vary over
        # mesh axes (updates of params sharded over a manual axis).
        axes = (aval_varying_axes(aval) or frozenset()) - (
            varying_axes(z) or frozenset()
        )
        out.append(cast_varying(z, tuple(sorted(axes))) if axes else z)
    return out


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
    keys = [is_typed_key(o) for o in old_leaves]
    check_same_shapes(
        old,
        new,
        expected_name="the inner state it was given",
        got_name="the inner optimizer's new state",
        hint="a state that is kept on some steps must keep its shapes.",
    )
    leaves = []
    for path_leaf, n, o, key in zip(
        jax.tree_util.tree_flatten_with_path(old)[0],
        new_leaves,
        old_leaves,
        keys,
        strict=True,
    ):
        if key:
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
