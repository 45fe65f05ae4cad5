"""How `MultiSteps` sees its state: on one device, or per device along a
mesh axis (`axis_name`), where each device accumulates its own gradients and
they are averaged once per window."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from .._leaves import is_none
from .._sharding import axis_names, summed_axes, varying_axes, varying_call
from .._tree import describe_value
from .accumulator import Accumulator, reduce_across
from .arithmetic import holds


def _varying_axes_of(grads: PyTree, acc: PyTree) -> Iterator[tuple]:
    """Each given gradient leaf: where, itself, and the axes it and `acc` vary over."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)
    for (path, g), a in zip(flat, treedef.flatten_up_to(acc), strict=True):
        if g is None:
            continue
        g_axes, a_axes = varying_axes(g), varying_axes(a)
        if g_axes is None or a_axes is None:
            return
        yield jax.tree_util.keystr(path) or "the root", g, g_axes, a_axes


class SingleDeviceState:
    """Without `axis_name`: the state is the state; nothing to reduce."""

    per_device = False

    def check_bound(self, method: str) -> None:
        del method

    def spec(self) -> Any:
        return jax.sharding.PartitionSpec()

    def add_axis(self, tree: PyTree) -> PyTree:
        return tree

    def drop_axis(self, acc: PyTree) -> PyTree:
        return acc

    def check_gradients(self, grads: PyTree, acc: PyTree) -> None:
        """Raises if the gradients vary over a mesh axis the accumulator
        does not (a data-parallel step without `axis_name`)."""
        for where, _, g_axes, a_axes in _varying_axes_of(grads, acc):
            extra = sorted(g_axes - a_axes, key=str)
            if extra:
                raise ValueError(
                    "MultiSteps: inside `jax.shard_map`, the gradients at "
                    f"{where} differ between devices along {extra}, but the "
                    "accumulator for them in the state is the same on every "
                    "device. To average the devices' gradients once per window, "
                    f"build MultiSteps with axis_name={extra[0]!r} and its state "
                    "with `opt.state_specs()`; for params that are split along "
                    "that axis, build the state with `opt.init` inside "
                    "`jax.shard_map` from those params, with their specs."
                )

    def agree(self, should_skip: jax.Array) -> jax.Array:
        return should_skip

    def index(self) -> jax.Array:
        """This device's index along the axis."""
        return jnp.zeros((), jnp.int32)

    def total(self, tree: PyTree) -> tuple[PyTree, int]:
        """The devices' values of `tree` summed, and their number."""
        return tree, 1

    def finish(
        self, acc: PyTree, accumulator: Accumulator, weight: Any, dtypes: PyTree
    ) -> tuple[PyTree, jax.Array | None]:
        """The window's accumulation, and whether its weights sum above 0."""
        del accumulator, weight, dtypes
        return acc, None


class PerDeviceState(SingleDeviceState):
    """With `axis_name`: `acc_grads` and `skip_state` hold this device's own
    values under a leading axis of length 1; one all-reduce per window."""

    per_device = True

    def __init__(self, axis_name: Hashable):
        self.axis_name = axis_name

    def check_bound(self, method: str) -> None:
        try:
            lax.axis_size(self.axis_name)
        except NameError as e:
            built = f"MultiSteps(axis_name={self.axis_name!r})"
            who = f"{built}.{method}"
            if method == "apply_gradients":
                who = f"optax_ext.apply_gradients with {built}"
            raise NameError(
                f"{who} must run where the mesh axis {self.axis_name!r} is "
                "bound, inside `jax.shard_map` (or `jax.vmap`/`jax.pmap` with "
                "that axis_name), with the state's `acc_grads` and `skip_state` "
                "split over it: pass `opt.state_specs()` as their in_specs and "
                f"out_specs. ({e})"
            ) from None

    def spec(self) -> Any:
        return jax.sharding.PartitionSpec(self.axis_name)

    def add_axis(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)

    def drop_axis(self, acc: PyTree) -> PyTree:
        def drop(path, x):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] != 1:
                raise ValueError(
                    f"MultiSteps(axis_name={self.axis_name!r}) expects this "
                    "device's accumulator, with a leading axis of length 1, at "
                    f"acc_grads{jax.tree_util.keystr(path)}; got shape "
                    f"{jnp.shape(x)}. Build the state with `opt.init` inside "
                    "`jax.shard_map` and pass `opt.state_specs()` as the "
                    "state's in_specs and out_specs."
                )
            return x[0]

        return jax.tree_util.tree_map_with_path(drop, acc)

    def check_gradients(self, grads: PyTree, acc: PyTree) -> None:
        """Raises if a gradient is the same on every device while the
        accumulator is not: while tracing, one `jax.grad` summed over the
        devices cannot be told from a value built alike on each (zeros)."""
        name = self.axis_name
        for where, g, g_axes, a_axes in _varying_axes_of(grads, acc):
            same = summed_axes(g_axes, a_axes, axis_names(name))
            if same:
                along = same[0] if len(same) == 1 else same
                cast = varying_call(along)
                raise ValueError(
                    f"MultiSteps(axis_name={name!r}) averages each device's own "
                    f"gradients once per window, but the gradient at {where} "
                    f"({describe_value(g)}) is the same on every device along "
                    f"{along!r}. Either `jax.grad` summed it over the devices "
                    "already (its params replicated under `jax.shard_map`), and "
                    "averaging would scale it: take the gradient with respect "
                    f"to `{cast}`. Or it is a value built the same on every "
                    "device, such as `jnp.zeros` for a frozen leaf: pass `"
                    + cast.replace("params", "zeros", 1)
                    + "`, or `jnp.zeros_like` of the cast params' leaf."
                )

    def agree(self, should_skip: jax.Array) -> jax.Array:
        """Every device takes the same skip decision."""
        votes = lax.psum(should_skip.astype(jnp.int32), self.axis_name)
        return votes > 0

    def index(self) -> jax.Array:
        return lax.axis_index(self.axis_name)

    def total(self, tree: PyTree) -> tuple[PyTree, int]:
        return lax.psum(tree, self.axis_name), lax.axis_size(self.axis_name)

    def finish(
        self, acc: PyTree, accumulator: Accumulator, weight: Any, dtypes: PyTree
    ) -> tuple[PyTree, jax.Array | None]:
        """Every device's accumulators and weights meet in one all-reduce,
        in the accumulator's dtype (the gradients' where it is narrower)."""
        leaves, treedef = jax.tree.flatten(acc)
        kinds = [accumulator] * len(leaves)
        mine = [a[0] for a in leaves]
        values, total = reduce_across(kinds, mine, weight, self.axis_name)
        pairs = zip(values, leaves, jax.tree.leaves(dtypes), strict=True)
        values = [v.astype(a.dtype if holds(a.dtype, d) else d) for v, a, d in pairs]
        keep = None if total is None else total > 0
        return jax.tree.unflatten(treedef, values), keep


def device_state(axis_name: Hashable | None) -> SingleDeviceState:
    return SingleDeviceState() if axis_name is None else PerDeviceState(axis_name)
