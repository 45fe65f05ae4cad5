"""How `MultiSteps` sees its state: on one device, or per device along a mesh
axis (`axis_name`), each accumulating its own gradients, averaged once per window."""

from collections.abc import Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
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

    drop_axis = agree = add_axis  # no axis to drop, no other device to agree with

    def check_gradients(self, grads: PyTree, acc: PyTree) -> None:
        """Raises if a gradient varies over a mesh axis its accumulator does not."""
        for where, _, g_axes, a_axes in _varying_axes_of(grads, acc):
            extra = sorted(g_axes - a_axes, key=str)
            if extra:
                raise ValueError(
                    f"MultiSteps: inside `jax.shard_map`, the gradients at {where} "
                    f"differ between devices along {extra}, but their accumulator "
                    "in the state does not. To average them once per window, pass "
                    f"axis_name={extra[0]!r} and `opt.state_specs()` as the state's "
                    "specs; for params split along that axis, `opt.init` the state "
                    "inside `jax.shard_map` from them, with their specs."
                )

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
        return acc, None


class PerDeviceState(SingleDeviceState):
    """With `axis_name`: `acc_grads` and `skip_state` hold this device's own
    values under a leading axis of length 1; one all-reduce per window."""

    per_device = True

    def __init__(self, axis_name: Hashable):
        self.axis_name = axis_name

    def check_bound(self, method: str) -> None:
        try:
            jax.lax.axis_size(self.axis_name)
        except NameError as e:
            built = f"MultiSteps(axis_name={self.axis_name!r})"
            fused = f"optax_ext.apply_gradients with {built}"
            who = fused if method == "apply_gradients" else f"{built}.{method}"
            raise NameError(
                f"{who} must run where the mesh axis {self.axis_name!r} is bound: "
                "inside `jax.shard_map` (or `jax.vmap`/`jax.pmap` with that "
                "axis_name), with `opt.state_specs()` as the in_specs and "
                f"out_specs of the state's `acc_grads` and `skip_state`. ({e})"
            ) from None

    def spec(self) -> Any:
        return jax.sharding.PartitionSpec(self.axis_name)

    def add_axis(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)

    def drop_axis(self, acc: PyTree) -> PyTree:
        for path, x in jax.tree_util.tree_leaves_with_path(acc):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] != 1:
                raise ValueError(
                    f"MultiSteps(axis_name={self.axis_name!r}) expects this device's "
                    "accumulator, with a leading axis of length 1, at acc_grads"
                    f"{jax.tree_util.keystr(path)}; got shape {jnp.shape(x)}. Build "
                    "the state with `opt.init` inside `jax.shard_map`, with "
                    "`opt.state_specs()` as its in_specs and out_specs."
                )
        return jax.tree.map(lambda x: x[0], acc)

    def check_gradients(self, grads: PyTree, acc: PyTree) -> None:
        """Raises if a gradient is the same on every device while its
        accumulator is not (tracing cannot tell a summed `jax.grad` from zeros)."""
        for where, g, g_axes, a_axes in _varying_axes_of(grads, acc):
            same = summed_axes(g_axes, a_axes, axis_names(self.axis_name))
            if same:
                along = same[0] if len(same) == 1 else same
                cast = varying_call(along)
                zeros = cast.replace("params", "zeros", 1)
                raise ValueError(
                    f"MultiSteps(axis_name={self.axis_name!r}) averages each "
                    f"device's own gradients once per window, but the gradient at "
                    f"{where} ({describe_value(g)}) is the same on every device "
                    f"along {along!r}. If `jax.grad` summed it over the devices "
                    "(replicated params under `jax.shard_map`), averaging would "
                    f"scale it: differentiate with respect to `{cast}`. If it is "
                    "built alike on every device, as `jnp.zeros` for a frozen leaf: "
                    f"pass `{zeros}` or `jnp.zeros_like` of the cast params' leaf."
                )

    def agree(self, should_skip: jax.Array) -> jax.Array:
        """Every device takes the same skip decision."""
        return jax.lax.psum(should_skip.astype(jnp.int32), self.axis_name) > 0

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name)

    def total(self, tree: PyTree) -> tuple[PyTree, int]:
        return jax.lax.psum(tree, self.axis_name), jax.lax.axis_size(self.axis_name)

    def finish(
        self, acc: PyTree, accumulator: Accumulator, weight: Any, dtypes: PyTree
    ) -> tuple[PyTree, jax.Array | None]:
        """Every device's accumulators and weights meet in one all-reduce, in
        the accumulator's dtype (the gradients' where it is narrower)."""
        leaves, treedef = jax.tree.flatten(acc)
        kinds, mine = [accumulator] * len(leaves), [a[0] for a in leaves]
        values, total = reduce_across(kinds, mine, weight, self.axis_name)
        pairs = zip(values, leaves, jax.tree.leaves(dtypes), strict=True)
        values = [v.astype(a.dtype if holds(a.dtype, d) else d) for v, a, d in pairs]
        return treedef.unflatten(values), None if total is None else total > 0
