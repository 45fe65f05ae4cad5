"""Running an inner optimizer on some steps only: `update_if`, in the form
a step chooses (`Form`); the compiler-facing details are `xla`'s."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from .._leaves import is_typed_key
from .._tree import cast_like, check_same_shapes
from . import xla


class Form(enum.Enum):
    """Where the inner optimizer runs."""

    CONDITIONAL = "conditional"  # in one `lax.cond`, on the steps it runs
    SELECTED = "selected"  # on every step, its results selected
    PER_PLATFORM = "per platform"  # the drop-in: `Mechanisms.drop_in_conditional_on`
    FOLD = "fold"  # not at all: the host says the window goes on


def choose_form(fused: bool, emit: bool | None, per_device: bool) -> Form:
    """The form of a `MultiSteps` step."""
    if emit is not None:
        return Form.SELECTED if emit else Form.FOLD
    return Form.CONDITIONAL if fused or per_device else Form.PER_PLATFORM


def _trace_once(step: Callable, operands: tuple) -> tuple[Callable, Any, Any]:
    """`step` traced once: the call for the running branch, the outputs'
    tree and the closed jaxpr."""
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        closed, shapes = jax.make_jaxpr(step, return_shape=True)(*operands)
        return (
            lambda *args: jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args)),
            jax.tree.structure(shapes),
            closed,
        )
    call = jax.jit(step, inline=True)
    traced = call.trace(*operands)
    return call, jax.tree.structure(traced.out_info), traced.jaxpr


class _Traced(NamedTuple):
    """The step `update_if` runs, traced once (`_trace_once`)."""

    call: Callable
    out_def: Any
    out_avals: list[Any]
    n_updates: int  # the updates' (or carry's) leaves, before the state's
    to_order: list[bool]  # `xla.old_value_read_first`


def _step(inner_update: Callable, operands: tuple, inner_state: PyTree, carry):
    """`inner_update` called, its new state (and carry) in the old avals."""
    if carry is None:
        new_updates, new_state = inner_update(*operands, inner_state)
        return new_updates, conform_state(new_state, inner_state)
    new_carry, new_state = inner_update(*operands, inner_state, carry)
    return conform_state(new_carry, carry), conform_state(new_state, inner_state)


def _traced(inner_update: Callable, operands: tuple, state: PyTree, carry) -> _Traced:
    def step(operands, inner_state, carry):
        return _step(inner_update, operands, inner_state, carry)

    call, out_def, closed = _trace_once(step, (operands, state, carry))
    n_state = len(jax.tree.leaves(state))
    n_updates = len(closed.out_avals) - n_state
    first_state = len(closed.jaxpr.invars) - n_state - len(jax.tree.leaves(carry))
    to_order = xla.old_value_read_first(closed.jaxpr, first_state, n_state, n_updates)
    return _Traced(call, out_def, list(closed.out_avals), n_updates, to_order)


def _called(traced: _Traced, operands: tuple, state: PyTree, carry) -> list:
    leaves = jax.tree.leaves(traced.call(operands, state, carry))
    # Evaluated eagerly, a constant output is a Python or NumPy value.
    return [cast_like(x, a) for x, a in zip(leaves, traced.out_avals, strict=True)]


def _conditional(pred, traced, operands, state, carry, counter, on) -> tuple:
    """The step in one `lax.cond`, the other branch returning the carry (or
    distinct zeros) and the state as they came in; `on`: the mechanisms."""
    ran, kept = counter

    def run(operands, state, carry, seed):
        (operands, state), count = xla.scalar_barrier((operands, state), ran, on)
        leaves = _called(traced, operands, state, carry)
        leaves = xla.state_after_updates(leaves, traced.n_updates, traced.to_order, on)
        return jax.tree.unflatten(traced.out_def, leaves), count

    def skip(operands, state, carry, seed):
        if carry is not None:
            return (carry, state), kept
        zeros = xla.distinct_zeros(traced.out_avals[: traced.n_updates], seed, on)
        updates_def = traced.out_def.children()[0]
        return (jax.tree.unflatten(updates_def, zeros), state), kept

    # The zeros' seed: any int32 scalar XLA cannot fold.
    seed = lax.convert_element_type(pred, jnp.int32)
    (result, new_state), count = lax.cond(pred, run, skip, operands, state, carry, seed)
    return result, new_state, count


def _selected(pred, traced, operands, state, carry, counter) -> tuple:
    """The step run unconditionally, its results and new state selected by
    `pred` (else the carry, or zeros, and the state as it came in)."""
    leaves = _called(traced, operands, state, carry)
    result, new_state = jax.tree.unflatten(traced.out_def, leaves)
    if carry is not None:
        result = jax.tree.map(lambda n, o: jnp.where(pred, n, o), result, carry)
    else:
        result = jax.tree.map(lambda u: jnp.where(pred, u, 0).astype(u.dtype), result)
    new_state = jax.tree.map(lambda n, o: jnp.where(pred, n, o), new_state, state)
    return result, new_state, jnp.where(pred, *counter)


def update_if(
    pred: jax.Array,
    inner_update: Callable[..., tuple[PyTree, PyTree]],
    operands: tuple,
    inner_state: PyTree,
    *,
    carry: PyTree = None,
    form: Form | None = None,
    mechanisms: xla.Mechanisms = xla.Mechanisms(),  # noqa: B008 - frozen
) -> tuple[PyTree, PyTree, jax.Array | None, tuple]:
    """`inner_update(*operands, inner_state)` where `pred`, else zero
    updates (or `carry`, which it then also takes) and `inner_state` as it
    came in, the new state in the old one's avals, with the XLA `mechanisms`.
    With a `form`, the third output is 1 where it ran, else 0; without, it
    is `None`, the step in a conditional, or decided where `pred` is known.
    The fourth is `operands`, zeroed where `pred` on the platforms where
    the per-platform form runs selected (`xla.cleared`)."""
    known = known_bool(pred)
    if known is not None and form is None:
        decided = _decided(known, inner_update, operands, inner_state, carry)
        return (*decided, None, operands)
    one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
    traced = _traced(inner_update, operands, inner_state, carry)
    args = (pred, traced, operands, inner_state, carry, (one, zero))
    if form is Form.SELECTED:
        result, new_state, count = _selected(*args)
    elif form is Form.PER_PLATFORM:
        (result, new_state, count), operands = xla.per_platform(
            lambda: (_selected(*args), xla.cleared(pred, operands, mechanisms)),
            lambda: (_conditional(*args, mechanisms), operands),
            mechanisms,
        )
    else:
        result, new_state, count = _conditional(*args, mechanisms)
    return result, new_state, None if form is None else count, operands


def _decided(
    known: bool, inner_update: Callable, operands: tuple, inner_state: PyTree, carry
) -> tuple[PyTree, PyTree]:
    """`update_if` where `pred` is known while tracing."""
    if known:
        return _step(inner_update, operands, inner_state, carry)
    if carry is not None:
        return carry, inner_state
    return _zeros_of(inner_update, operands, inner_state), inner_state


def known_bool(x: Any) -> bool | None:
    """`x` as a Python bool where it is known while tracing, else `None`."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _zeros_of(inner_update: Callable, operands: tuple, inner_state: PyTree) -> PyTree:
    """Zeros of the types of `inner_update`'s updates, without running it."""
    shapes, _ = jax.eval_shape(inner_update, *operands, inner_state)
    return jax.tree.map(lambda s: lax.full(s.shape, 0, s.dtype), shapes)


def conform_state(new: PyTree, old: PyTree) -> PyTree:
    """The inner optimizer's new state in its old dtypes and weak types."""
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
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(old)[0]]
    for path, n, o, key in zip(paths, new_leaves, old_leaves, keys, strict=True):
        if key:
            if n.dtype != o.dtype:
                raise ValueError(
                    f"The inner optimizer changed the key type of its state leaf "
                    f"at {jax.tree_util.keystr(path)} from {o.dtype} to "
                    f"{n.dtype}."
                )
            leaves.append(n)
        else:
            leaves.append(cast_like(n, o))
    return jax.tree.unflatten(old_def, leaves)
