"""Which outputs of a jaxpr read which of its inputs.

A pure analysis, used by `update_if` before it orders writes: a forward
pass of bit masks over the equations (`flow`), looking into calls and
conditionals; `state_read_by_updates` and `grad_readers` phrase the two
questions the ordering asks of an inner optimizer's traced step.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex_core

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

# A variable's adjustment: the bits its users do not see, and those they
# see in addition.
Adjust = dict[Any, tuple[int, int]]


def flow(jaxpr: Any, in_masks: list[int], adjust: Adjust) -> list[int]:
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


def _eqn_flow(eqn: Any, masks: list[int], adjust: Adjust) -> list[int]:
    """The masks of `eqn`'s outputs (see `flow`)."""
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
            got = flow(branch.jaxpr, operands, _inner_adjust(branch.jaxpr, eqn, adjust))
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
                return flow(inner, masks, _inner_adjust(inner, eqn, adjust))
    union = 0
    for mask in masks:
        union |= mask
    return [union] * len(eqn.outvars)


def _inner_adjust(inner: Any, eqn: Any, adjust: Adjust) -> Adjust:
    """`adjust` of `eqn`'s outputs, moved onto the inner jaxpr's variables
    that define them. An inner output that is an inner input (returned as
    it came in) is left alone: its other users inside read the input."""
    inputs = set(inner.invars)
    moved: Adjust = {}
    for v, out in zip(inner.outvars, eqn.outvars, strict=True):
        if out in adjust and isinstance(v, jex_core.Var) and v not in inputs:
            clear, set_ = moved.get(v, (0, 0))
            c, s = adjust[out]
            moved[v] = (clear | c, set_ | s)
    return moved


def _marks(outvars: list[Any], inputs: set[Any], bit: Any) -> Adjust:
    """For each variable among `outvars` that is computed (not an input),
    the adjustment `bit(i)` of output `i`, merged where one variable is
    several outputs."""
    marks: Adjust = {}
    for i, v in enumerate(outvars):
        if isinstance(v, jex_core.Var) and v not in inputs:
            clear, set_ = marks.get(v, (0, 0))
            c, s = bit(i)
            marks[v] = (clear | c, set_ | s)
    return marks


def grad_readers(jaxpr: Any, *, n_grads: int, n_consts: int = 0) -> list[int]:
    """Indices of the outputs (updates, then new state) of `step`'s jaxpr
    whose value depends on the `n_grads` inputs after the first `n_consts`
    (the gradients after the values `step` closes over), leaving out those that
    another such output depends on (Adam's new moments, which its updates
    read): an output computed after them is computed after their reads of
    the inputs too. The analysis looks into calls and conditionals
    (`flow`); other equations with inner jaxprs pass every input's
    dependency to every output, which can only add outputs."""
    n_in = len(jaxpr.invars)
    grads_bit = [0] * n_consts + [1] * n_grads + [0] * (n_in - n_consts - n_grads)
    reading = flow(jaxpr, grads_bit, {})
    readers = [i for i, m in enumerate(reading) if m]
    # Which outputs each output is computed from, one bit per output: the
    # users of output `i` see its bit.
    upstream = flow(
        jaxpr, [0] * n_in, _marks(jaxpr.outvars, set(), lambda i: (0, 1 << i))
    )
    behind = 0
    for i in readers:
        behind |= upstream[i]
    return [i for i in readers if not behind >> i & 1]


def state_read_by_updates(
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

    A forward pass (`flow`) with one bit per state leaf; the bit of leaf
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
    blocked = _marks(new_state, inputs, lambda i: (1 << i, 0))
    update_bits = flow(jaxpr, in_masks, blocked)[:n_updates]
    # Which updates each new state leaf is computed from (a nested
    # `update_if` has ordered it after them already): those need nothing.
    marks = _marks(jaxpr.outvars[:n_updates], inputs, lambda j: (0, 1 << j))
    after = flow(jaxpr, [0] * len(jaxpr.invars), marks)[n_updates:]
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
