"""Flax NNX modules as `microbatched` arguments: split together (what they share
stays shared), merged in each trace of `grad_fn`, the state it sets carried through
the loop and written back (why: docs/design.md, "Flax NNX")."""

import sys
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


class SplitNodes(eqx.Module):
    """The NNX-holding arguments, `nnx.split` together, in the first's place."""

    graphdef: Any = eqx.field(static=True)
    state: Any
    keys: tuple = eqx.field(static=True)  # the arguments' positions and names


class SplitAway(eqx.Module):
    """An argument held in the `SplitNodes` of an earlier one."""


def split_graph_nodes(
    args: tuple, kwargs: dict, keep: Collection[int | None]
) -> tuple[tuple, dict, dict]:
    """`args` and `kwargs` with the values holding an NNX graph node (not at
    `keep`) split together; and those values, by position or name."""
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
    """The split modules' state leaves that `grad_fn` sets (BatchNorm's statistics),
    by index: found by tracing one call, carried through the loop, written back."""

    def __init__(self, originals: dict[int | str, Any]):
        self.originals = originals

    def _node(self, args: tuple, kwargs: dict) -> SplitNodes:
        return _by_key(args, kwargs)[next(iter(self.originals))]

    def initial(self, micro: Any, changed: dict) -> dict:
        """The leaves `grad_fn` sets (`changed`'s keys) as given; refused per device."""
        if changed and micro.axis_name is not None:
            raise ValueError(
                f"microbatched, per device over {micro.axis_name!r}: grad_fn "
                "changes the state of an NNX module it is passed (BatchNorm's "
                "statistics, an nnx.Rngs count), which each device would change "
                "its own way. Keep such state out of the module there."
            )
        leaves = jax.tree.leaves(self._node(micro.args, micro.kwargs).state)
        return {i: leaves[i] for i in changed}

    def _state(self, node: SplitNodes, values: dict) -> Any:
        """`node`'s state with the leaves `grad_fn` sets taken from `values`."""
        leaves, treedef = jax.tree.flatten(node.state)
        leaves = [values.get(i, leaf) for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(treedef, leaves)

    def call(self, fn: Callable, args: tuple, kwargs: dict, carried: dict | None):
        """`fn` run with the modules merged with the `carried` leaves: its output, and
        those leaves after it (`carried` None: the leaves `fn` sets, by identity)."""
        nnx, node = sys.modules["flax.nnx"], self._node(args, kwargs)
        merged = nnx.merge(node.graphdef, self._state(node, carried or {}))
        at = dict(zip(node.keys, merged, strict=True))
        positional = (at.get(i, a) for i, a in enumerate(args))
        out = fn(*positional, **{k: at.get(k, v) for k, v in kwargs.items()})
        after = jax.tree.leaves(nnx.as_pure(nnx.state(merged)))
        keys = _set_leaves(node.state, after) if carried is None else carried
        return out, {i: after[i] for i in keys}

    def write_back(self, args: tuple, kwargs: dict, carried: dict) -> None:
        """The `carried` leaves written into the modules as they were given."""
        if carried:
            state = self._state(self._node(args, kwargs), carried)
            sys.modules["flax.nnx"].update(tuple(self.originals.values()), state)


def _by_key(args: tuple, kwargs: dict) -> dict[int | str, Any]:
    """The arguments by position and name."""
    return {**dict(enumerate(args)), **kwargs}


def _set_leaves(state: Any, after: list) -> list[int]:
    """The state leaves `grad_fn` set, refused where it changes their tree or type."""
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(after) != len(paths):
        raise ValueError(
            f"grad_fn changed the structure of the NNX modules it was passed "
            f"({len(paths)} state leaves, then {len(after)}); microbatched "
            "carries their state from micro-batch to micro-batch, which needs one."
        )
    for (path, old), new in zip(paths, after, strict=True):
        if new is not old and _aval(old) != _aval(new):
            raise ValueError(
                f"grad_fn changed an NNX module's state at {jax.tree_util.keystr(path)}"
                f" from {_aval(old)} to {_aval(new)}; microbatched carries it from "
                "micro-batch to micro-batch, which needs one shape and dtype."
            )
    return [i for i, new in enumerate(after) if new is not paths[i][1]]


def _aval(x: Any) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"
