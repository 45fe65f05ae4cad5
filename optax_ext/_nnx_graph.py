"""Flax NNX modules as `microbatched` arguments: split together before the
loop (what they share stays shared), merged in each trace of `grad_fn`,
and the state `grad_fn` changes in them carried from micro-batch to
micro-batch, then written back (why: docs/design.md, "Flax NNX")."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


class SplitNodes(eqx.Module):
    """The arguments holding NNX graph nodes, split together by `nnx.split`:
    in the first one's place, `SplitAway` in the others'."""

    graphdef: Any = eqx.field(static=True)
    state: Any
    keys: tuple = eqx.field(static=True)  # the arguments' positions and names


class SplitAway(eqx.Module):
    """An argument held in the `SplitNodes` of an earlier one."""


def split_graph_nodes(
    args: tuple, kwargs: dict, keep: Collection[int | None]
) -> tuple[tuple, dict, dict]:
    """`args` and `kwargs` with the values holding an NNX graph node (but at
    the positions `keep`) split together, and those values as given, by
    position or name."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return args, kwargs, {}
    found = {}
    for key, value in _by_key(args, kwargs).items():
        leaves = jax.tree.leaves(value, is_leaf=nnx.graph.is_graph_node)
        if key not in keep and any(map(nnx.graph.is_graph_node, leaves)):
            found[key] = value
    if not found:
        return args, kwargs, found
    graphdef, state = nnx.split(tuple(found.values()))
    first = SplitNodes(graphdef, nnx.as_pure(state), tuple(found))
    new = {k: first if k == first.keys[0] else SplitAway() for k in found}
    args = tuple(new.get(i, a) for i, a in enumerate(args))
    return args, {k: new.get(k, v) for k, v in kwargs.items()}, found


class ModuleCarry:
    """The state leaves of the split modules that `grad_fn` sets (BatchNorm's
    statistics, an `nnx.Rngs` count), by their index among the state's
    leaves: found by a trace of one call, whose result they are; carried
    through the loop, written back into the modules after it."""

    def __init__(self, originals: dict[int | str, Any]):
        self.originals = originals

    def _node(self, args: tuple, kwargs: dict) -> SplitNodes:
        return _by_key(args, kwargs)[next(iter(self.originals))]

    def initial(self, micro: Any, axis_name: Any, changed: dict) -> dict:
        """The leaves `grad_fn` sets (the keys of `changed`), as they came in;
        refused per device, where each device would set them its own way."""
        if changed and axis_name is not None:
            raise ValueError(
                f"microbatched, per device over {axis_name!r}: grad_fn changes the "
                "state of an NNX module it is passed (BatchNorm's statistics, an "
                "nnx.Rngs count), which each device would change its own way. "
                "Keep such state out of the module there."
            )
        leaves = jax.tree.leaves(self._node(micro.args, micro.kwargs).state)
        return {i: leaves[i] for i in changed}

    def _state(self, node: SplitNodes, values: dict) -> Any:
        """`node`'s state with the leaves `grad_fn` sets taken from `values`."""
        leaves, treedef = jax.tree.flatten(node.state)
        leaves = [values.get(i, leaf) for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(treedef, leaves)

    def call(self, fn: Callable, args: tuple, kwargs: dict, carried: dict | None):
        """`fn` on the arguments, the modules merged with the `carried`
        leaves; `fn`'s output and those leaves after it (`carried` None: the
        modules as they came in, and the leaves `fn` sets, found by identity)."""
        nnx, node = sys.modules["flax.nnx"], self._node(args, kwargs)
        merged = nnx.merge(node.graphdef, self._state(node, carried or {}))
        at = dict(zip(node.keys, merged, strict=True))
        positional = (at.get(i, a) for i, a in enumerate(args))
        out = fn(*positional, **{k: at.get(k, v) for k, v in kwargs.items()})
        after = jax.tree.leaves(nnx.as_pure(nnx.state(merged)))
        keys = _set_leaves(node.state, after) if carried is None else carried
        return out, {i: after[i] for i in keys}

    def write_back(self, args: tuple, kwargs: dict, carried: dict) -> None:
        """The `carried` leaves, after the loop, written into the modules as
        they were given."""
        if carried:
            state = self._state(self._node(args, kwargs), carried)
            sys.modules["flax.nnx"].update(tuple(self.originals.values()), state)


def _by_key(args: tuple, kwargs: dict) -> dict[int | str, Any]:
    """The arguments by position and name."""
    return {**dict(enumerate(args)), **kwargs}


def _set_leaves(state: Any, after: list) -> list[int]:
    """Which of the modules' state leaves `grad_fn` set to new arrays;
    raises where it changed their structure, a shape or a dtype."""
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(after) != len(paths):
        raise ValueError(
            f"grad_fn changed the structure of the NNX modules it was passed "
            f"({len(paths)} state leaves, then {len(after)}); microbatched "
            "carries their state from micro-batch to micro-batch, which needs one."
        )
    changed = []
    for i, ((path, old), new) in enumerate(zip(paths, after, strict=True)):
        if new is old:
            continue
        changed.append(i)
        was, now = _aval(old), _aval(new)
        if was != now:
            raise ValueError(
                f"grad_fn changed an NNX module's state at "
                f"{jax.tree_util.keystr(path)} from {was} to {now}; microbatched "
                "carries it from micro-batch to micro-batch, which needs one "
                "shape and dtype."
            )
    return changed


def _aval(x: Any) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"
