"""Where `microbatched`'s loop runs (as it is, in a `jax.shard_map` over the batch's
mesh axes, or in the caller's over `axis_name`), and the one reduction after it."""

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._accumulate.accumulator import reduce_across
from ._accumulate.arithmetic import work_dtype
from ._microbatched_loop import GradientRows, Looped, LoopSettings, Rows, accumulate
from ._sharding import axis_names, manual_axes, shards_over, typed_sharding
from ._tree import cast_like


def _is_manual(axis_name: Hashable) -> bool:
    """Whether `axis_name` is bound here as a collective axis."""
    mesh, names = jax.sharding.get_abstract_mesh(), axis_names(axis_name)
    if mesh.axis_names and all(n in mesh.axis_names for n in names):
        return manual_axes(names) == names
    try:
        lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _batch_spec(args: tuple, argnums: tuple[int, ...]) -> tuple[Any, Any]:
    """The mesh axes the batch's type splits its rows over, and the mesh; or Nones."""
    shardings = [typed_sharding(x) for i in argnums for x in jax.tree.leaves(args[i])]
    specs = {None if s is None else s.spec[0] for s in shardings}
    spec = specs.pop() if len(specs) == 1 else None
    return (None, None) if spec is None else (spec, shardings[-1].mesh)


def run_on_devices(
    settings: LoopSettings, axis_name: Hashable | None, args: tuple, kwargs: dict
) -> tuple[PyTree, dict]:
    """`microbatched`'s output, run where the batch lies, and the NNX leaves carried."""
    if axis_name is not None and _is_manual(axis_name):
        return _joined(*_run(settings, axis_name, args, kwargs))
    spec, mesh = _batch_spec(args, settings.batch_argnums)
    if spec is not None and axis_name is not None:
        split = axis_names(spec)
        if not set(axis_names(axis_name)) <= set(split):
            raise ValueError(
                f"microbatched(axis_name={axis_name!r}): the batch's type says "
                f"it is split over the mesh axes {split} (Explicit axes), and "
                "the loop averages over those; axis_name names another. "
                "Leave axis_name out, or name the batch's axes."
            )
    if spec is None and axis_name is not None:
        mesh = jax.sharding.get_abstract_mesh()
        if not all(n in mesh.axis_names for n in axis_names(axis_name)):
            raise ValueError(
                f"microbatched(axis_name={axis_name!r}) needs that axis bound: call "
                "it inside jax.shard_map over it, or under jax.set_mesh(mesh) with a "
                f"mesh that has it; the mesh here has axes {mesh.axis_names}."
            )
        spec = axis_name
    others = [a for i, a in enumerate(args) if i not in settings.batch_argnums]
    if spec is None or shards_over((others, kwargs), spec):  # FSDP params
        regather = jax.device_count() > 1
        return _joined(*_run(settings, None, args, kwargs, regather=regather))
    return _in_shard_map(settings, mesh, spec, args, kwargs), {}


def _run(
    settings: LoopSettings,
    axis_name: Hashable | None,
    args: tuple,
    kwargs: dict,
    *,
    regather: bool = False,
) -> tuple[PyTree, PyTree, PyTree, dict]:
    """The output after the loop and reduction: its per-example rows, its other arrays
    (each `None` in the other's places), the rest; and the NNX leaves carried."""
    looped = accumulate(settings, axis_name, args, kwargs, regather=regather)
    values, total, devices = looped.accumulators, looped.weight, 1
    if axis_name is not None:  # the outputs and the weights' sum in one all-reduce
        weight = None if looped.weights is None else total
        values, total = reduce_across(looped.kinds, values, weight, axis_name)
        devices = lax.axis_size(axis_name)
    results = []
    for kind, a, s in zip(looped.kinds, values, looped.structs, strict=True):
        if isinstance(kind, GradientRows):
            a = _batch_share(a, kind, looped, total, devices)
        if isinstance(kind, Rows):  # `(rows, k, ...)` as the batch's rows
            a = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
        results.append(cast_like(a, s))
    tree = jax.tree_util.tree_unflatten(looped.treedef, results)
    rows = [isinstance(kind, Rows) for kind in looped.kinds]
    rows = jax.tree_util.tree_unflatten(looped.treedef, rows)
    return *eqx.partition(tree, rows), looped.static, looped.carried


def _joined(rows: PyTree, others: PyTree, static: PyTree, carried: dict) -> tuple:
    return eqx.combine(rows, others, static), carried


@jax.tree_util.register_static
class _Static:
    """The output's non-arrays, out of `jax.shard_map` as a leafless node's treedef."""

    def __init__(self, value: PyTree):
        self.value = value


def _batch_share(
    acc: jax.Array, kind: GradientRows, looped: Looped, total: Any, devices: int
) -> jax.Array:
    """Gradient rows `(rows, k, ...)`, each micro-batch's scaled by its batch share."""
    wide = acc.astype(work_dtype(acc.dtype))
    by_microbatch = (1, acc.shape[1]) + (1,) * (acc.ndim - 2)
    if looped.weights is None:
        count = jnp.asarray(looped.count, jnp.int32) if kind.accumulator.mean else 1
        count = jnp.maximum(count, 1) * devices
        return (wide / count.astype(wide.real.dtype)).astype(acc.dtype)
    w = looped.weights.astype(wide.real.dtype)
    if kind.accumulator.mean:
        safe = jnp.where(total > 0, total, jnp.ones_like(total)).astype(w.dtype)
        w = jnp.where(w > 0, w / safe, jnp.zeros_like(w))
    share = w.reshape(by_microbatch)
    scaled = jnp.where(share > 0, wide * share, jnp.zeros_like(wide))
    return scaled.astype(acc.dtype)


def _in_shard_map(
    settings: LoopSettings, mesh: Any, spec: Any, args: tuple, kwargs: dict
) -> PyTree:
    """The loop in a `jax.shard_map` manual only over the axes splitting the batch."""
    axes = axis_names(spec)
    (dyn_args, dyn_kwargs), static = eqx.partition((args, kwargs), eqx.is_array)
    batch = settings.batch_argnums
    in_specs = tuple(P(spec) if i in batch else P() for i in range(len(dyn_args)))
    count = settings.num_real_microbatches
    traced = isinstance(count, jax.Array)  # a shard_map input, else a constant

    def local(dyn_args, dyn_kwargs, c):
        args, kwargs = eqx.combine((dyn_args, dyn_kwargs), static)
        here = settings._replace(num_real_microbatches=c if traced else count)
        rows, others, out_static, _ = _run(here, spec, tuple(args), kwargs)
        return rows, others, _Static(out_static)  # nothing carried: refused

    try:
        rows, others, out_static = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(in_specs, P(), P()),
            out_specs=(P(spec), P(), P()),
            axis_names=set(axes),
        )(tuple(dyn_args), dyn_kwargs, count if traced else 0)
    except NotImplementedError as error:
        if "Closing over inputs to shard_map" not in str(error):
            raise
        raise ValueError(
            "microbatched runs grad_fn (and weight_fn) in a jax.shard_map over the "
            f"batch's Explicit mesh axes {axes}, which cannot close over a traced "
            "value of the surrounding jit. Pass such values as arguments of grad_fn "
            "(given to the microbatched call, which hands them on unchanged), not "
            f"from the enclosing function. ({str(error).splitlines()[0]})"
        ) from None
    return eqx.combine(rows, others, out_static.value)
