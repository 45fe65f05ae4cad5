"""Flax NNX modules as `microbatched` arguments: split before the loop,
merged in each trace of `grad_fn` (why: docs/design.md, "Flax NNX").
"""

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


def _holds_graph_node(value: Any, is_graph_node: Callable) -> bool:
    leaves = jax.tree.leaves(value, is_leaf=is_graph_node)
    return any(is_graph_node(leaf) for leaf in leaves)


def split_graph_nodes(
    args: tuple, kwargs: dict, keep: Collection[int | None]
) -> tuple[tuple, dict, bool]:
    """`args` and `kwargs` with each value holding an NNX graph node split
    into a `SplitNode` (but at the positions `keep`), and whether any was."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return args, kwargs, False
    is_node = nnx.graph.is_graph_node

    def split(value: Any) -> Any:
        if not _holds_graph_node(value, is_node):
            return value
        graphdef, state = nnx.split(value)
        return SplitNode(graphdef, nnx.as_pure(state))

    new_args = tuple(a if i in keep else split(a) for i, a in enumerate(args))
    new_kwargs = {name: split(v) for name, v in kwargs.items()}
    found = any(isinstance(v, SplitNode) for v in (*new_args, *new_kwargs.values()))
    return new_args, new_kwargs, found


def merging(fn: Callable) -> Callable:
    """`fn` called with each `SplitNode` argument merged back."""
    nnx = sys.modules["flax.nnx"]

    def merge(value: Any) -> Any:
        if isinstance(value, SplitNode):
            return nnx.merge(value.graphdef, value.state)
        return value

    def merged(*args: Any, **kwargs: Any) -> Any:
        args = tuple(merge(a) for a in args)
        return fn(*args, **{name: merge(v) for name, v in kwargs.items()})

    merged.__name__ = getattr(fn, "__name__", "grad_fn")
    return merged
