"""Running an inner optimizer on some steps only: `update_if`, in the form
a step chooses (`Form`); the compiler-facing details are `xla`'s."""

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from .._leaves import is_typed_key
from .._tree import cast_like, check_same_shapes, known_bool
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


def _step(inner_update: Callable, operands: tuple, inner_state: PyTree, carry):
    """`inner_update` called, its new state (and carry) in the old avals."""
    given = () if carry is None else (carry,)
    out, new_state = inner_update(*operands, inner_state, *given)
    out = out if carry is None else conform_state(out, carry)
    return out, conform_state(new_state, inner_state)


class _Traced:
    """`_step` traced once; under `jax.disable_jit`, its jaxpr evaluated."""

    def __init__(self, inner_update: Callable, operands: tuple, state: PyTree, carry):
        step = lambda *args: _step(inner_update, *args)
        args = (operands, state, carry)
        if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
            closed, shapes = jax.make_jaxpr(step, return_shape=True)(*args)
            self.call = lambda *a: jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(a))
            self.out_def = jax.tree.structure(shapes)
        else:
            self.call = call = jax.jit(step, inline=True)
            traced = call.trace(*args)
            closed, self.out_def = traced.jaxpr, jax.tree.structure(traced.out_info)
        self.out_avals, jaxpr = list(closed.out_avals), closed.jaxpr
        n_state = len(jax.tree.leaves(state))  # outputs: updates (or carry), state
        self.n_updates = n_updates = len(self.out_avals) - n_state
        first = len(jaxpr.invars) - n_state - len(jax.tree.leaves(carry))
        old = jaxpr.invars[first : first + n_state]  # the state's inputs
        self.to_order = xla.old_value_read_first(jaxpr, old, n_updates)

    def leaves(self, operands: tuple, state: PyTree, carry: PyTree) -> list:
        """The output leaves in their avals (eager constants are Python or NumPy)."""
        leaves = jax.tree.leaves(self.call(operands, state, carry))
        return [cast_like(x, a) for x, a in zip(leaves, self.out_avals, strict=True)]


def _conditional(pred, traced, operands, state, carry, on) -> tuple:
    """The step in a `lax.cond`, its idle branch giving carry (or zeros) and state."""
    ran, kept = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)  # the count

    def run(operands, state, carry, seed):
        operands, state, count = xla.scalar_barrier((operands, state, ran), on)
        leaves = traced.leaves(operands, state, carry)
        leaves = xla.state_after_updates(leaves, traced.to_order, on)
        return *jax.tree.unflatten(traced.out_def, leaves), count

    def skip(operands, state, carry, seed):
        if carry is None:
            zeros = xla.distinct_zeros(traced.out_avals[: traced.n_updates], seed, on)
            carry = jax.tree.unflatten(traced.out_def.children()[0], zeros)
        return carry, state, kept

    seed = lax.convert_element_type(pred, jnp.int32)  # the zeros': XLA can't fold it
    return lax.cond(pred, run, skip, operands, state, carry, seed)


def _selected(pred, traced, operands, state, carry) -> tuple:
    """The step run unconditionally, its outputs selected by `pred`."""
    leaves = traced.leaves(operands, state, carry)
    result, new_state = jax.tree.unflatten(traced.out_def, leaves)
    where = lambda n, o: jnp.where(pred, n, o)
    if carry is None:
        result = jax.tree.map(lambda u: where(u, 0).astype(u.dtype), result)
    else:
        result = jax.tree.map(where, result, carry)
    count = where(jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32))  # ran, else kept
    return result, jax.tree.map(where, new_state, state), count


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
    """`inner_update(*operands, inner_state)` where `pred`, else zero updates (or
    `carry`, which it then also takes) and `inner_state`; the new state in the old
    avals; 1 where it ran, else 0 (`None` without a `form`: a conditional, or decided
    where `pred` is known); `operands`, `xla.cleared` where the drop-in selects."""
    if form is Form.FOLD:  # decided by the host: the window goes on
        kept = update_if(False, inner_update, operands, inner_state, carry=carry)
        return *kept[:2], jnp.zeros((), jnp.int32), operands
    if form is None and (known := known_bool(pred)) is not None:  # decided now
        if known:
            return (*_step(inner_update, operands, inner_state, carry), None, operands)
        if carry is None:  # zero updates, of the types `inner_update` gives
            shapes, _ = jax.eval_shape(inner_update, *operands, inner_state)
            carry = jax.tree.map(lambda s: lax.full(s.shape, 0, s.dtype), shapes)
        return carry, inner_state, None, operands
    traced = _Traced(inner_update, operands, inner_state, carry)
    args = (pred, traced, operands, inner_state, carry)
    if form is Form.SELECTED:
        result, new_state, count = _selected(*args)
    elif form is Form.PER_PLATFORM:
        (result, new_state, count), operands = xla.per_platform(
            lambda clear: (_selected(*args), xla.cleared(pred, operands, clear)),
            lambda: (_conditional(*args, mechanisms), operands),
            mechanisms,
        )
    else:
        result, new_state, count = _conditional(*args, mechanisms)
    return result, new_state, None if form is None else count, operands


def conform_state(new: PyTree, old: PyTree) -> PyTree:
    """The inner optimizer's new state in its old dtypes and weak types (a typed
    key as it is)."""
    names = dict(
        expected_name="the inner state it was given",
        got_name="the inner optimizer's new state",
        hint="a state kept on some steps must keep its tree and shapes.",
    )
    check_same_shapes(old, new, **names)
    return jax.tree.map(
        lambda o, n: n if is_typed_key(o) else cast_like(n, o), old, new
    )
