"""Flax NNX modules as `microbatched` arguments: split before the loop,
merged in each trace of `grad_fn`, and the state `grad_fn` changes in
them carried from micro-batch to micro-batch, then written back (why:
docs/design.md, "Flax NNX")."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx
import jax


class SplitNode(eqx.Module):
    """An argument holding NNX graph nodes, as `nnx.split` gives it."""

    graphdef: Any = eqx.field(static=True)
    state: Any


def split_graph_nodes(
    args: tuple, kwargs: dict, keep: Collection[int | None]
) -> tuple[tuple, dict, dict]:
    """`args` and `kwargs` with each value holding an NNX graph node split
    into a `SplitNode` (but at the positions `keep`), and those values as
    given, by position or name."""
    nnx = sys.modules.get("flax.nnx")
    found: dict[int | str, Any] = {}
    if nnx is None:
        return args, kwargs, found

    def split(key: int | str, value: Any) -> Any:
        leaves = jax.tree.leaves(value, is_leaf=nnx.graph.is_graph_node)
        if key in keep or not any(map(nnx.graph.is_graph_node, leaves)):
            return value
        found[key] = value
        graphdef, state = nnx.split(value)
        return SplitNode(graphdef, nnx.as_pure(state))

    args = tuple(split(i, a) for i, a in enumerate(args))
    return args, {k: split(k, v) for k, v in kwargs.items()}, found


class ModuleCarry:
    """The state leaves of the split modules that `grad_fn` sets (BatchNorm's
    statistics, an `nnx.Rngs` count): found on its first trace, carried
    through the loop, written back into the modules after it."""

    def __init__(self, originals: dict[int | str, Any]):
        self.originals = originals
        self.changed: dict[int | str, list[int]] = {}
        self.final: list[Any] = []

    def _nodes(self, args: tuple, kwargs: dict) -> dict[int | str, list]:
        """Each split module's state leaves."""
        return {
            k: jax.tree.leaves(v.state)
            for k, v in [*enumerate(args), *kwargs.items()]
            if k in self.originals
        }

    def initial(self, micro: Any, axis_name: Any) -> list[Any]:
        """The leaves `grad_fn` sets, as they came in; refused per device,
        where each device would set them its own way."""
        if self.changed and axis_name is not None:
            raise ValueError(
                f"microbatched, per device over {axis_name!r}: grad_fn changes the "
                "state of an NNX module it is passed (BatchNorm's statistics, an "
                "nnx.Rngs count), which each device would change its own way. "
                "Keep such state out of the module there."
            )
        nodes = self._nodes(micro.args, micro.kwargs)
        return [nodes[k][i] for k, at in self.changed.items() for i in at]

    def _state(self, node: SplitNode, leaves: list, values: Any, key: Any) -> Any:
        """`node`'s state with the leaves `grad_fn` sets taken from `values`
        (an iterator; `None`: none taken)."""
        if values is not None:
            for i in self.changed.get(key, []):
                leaves[i] = next(values)
        return jax.tree.unflatten(jax.tree.structure(node.state), leaves)

    def call(self, fn: Callable, args: tuple, kwargs: dict, carried: list | None):
        """`fn` on the arguments, each module merged with the `carried`
        leaves (`None`: as it came in, the first trace, which finds the
        leaves `fn` sets); `fn`'s output and those leaves after it."""
        nnx, given = sys.modules["flax.nnx"], self._nodes(args, kwargs)
        values = None if carried is None else iter(carried)
        split = _by_key(args, kwargs)
        merged = {
            k: nnx.merge(split[k].graphdef, self._state(split[k], list(v), values, k))
            for k, v in given.items()
        }
        positional = (merged.get(i, a) for i, a in enumerate(args))
        out = fn(*positional, **{k: merged.get(k, v) for k, v in kwargs.items()})
        after = {
            k: jax.tree.leaves(nnx.as_pure(nnx.state(m))) for k, m in merged.items()
        }
        if carried is None:
            found = {k: _set_leaves(after[k], given[k], k) for k in given}
            self.changed = {k: at for k, at in found.items() if at}
        return out, [after[k][i] for k, at in self.changed.items() for i in at]

    def write_back(self, args: tuple, kwargs: dict) -> None:
        """The carried leaves written into the modules as they were given."""
        nodes, values = self._nodes(args, kwargs), iter(self.final)
        split = _by_key(args, kwargs)
        for key in self.changed:
            state = self._state(split[key], nodes[key], values, key)
            sys.modules["flax.nnx"].update(self.originals[key], state)


def _by_key(args: tuple, kwargs: dict) -> dict[int | str, Any]:
    """The arguments by position and name."""
    return {**dict(enumerate(args)), **kwargs}


def _set_leaves(after: list, before: list, key: Any) -> list[int]:
    """Which of a module's state leaves `grad_fn` set to new arrays."""
    if len(after) != len(before):
        raise ValueError(
            f"grad_fn changed the structure of the NNX module passed as {key!r} "
            f"({len(before)} state leaves, then {len(after)}); microbatched "
            "carries its state from micro-batch to micro-batch, which needs one."
        )
    return [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a is not b]
