"""The loop of `microbatched` on this device's rows: `grad_fn` on each of
`k` micro-batches in a `lax.fori_loop`, each output leaf folded by its kind."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._accumulate.accumulator import (
    Accumulator,
    AnyOf,
    Count,
    GradientRows,
    Rows,
    Weights,
    weight_dtype,
)
from ._accumulate.arithmetic import accumulator_dtype_for
from ._sharding import (
    axis_names,
    cast_varying,
    manual_axes,
    sharded_type,
    split_leading,
    summed_axes,
    varying_axes,
    zeros_like_struct,
)
from ._tree import describe_value, is_real_scalar


class LoopSettings(NamedTuple):
    """What `microbatched` was built with, checked (see its docstring)."""

    grad_fn: Callable
    num_microbatches: int
    batch_argnums: tuple[int, ...]
    key_argnum: int | None
    accumulator_dtype: Any
    weight_fn: Callable | None
    per_example: Any
    num_real_microbatches: Any
    mean: bool = True
    modules: Any = None  # `_nnx_graph.ModuleCarry` where NNX modules were split


class Looped(NamedTuple):
    """The loop's result on this device, per combined output leaf."""

    kinds: list[Any]  # per leaf: `Accumulator`, `Count`, `AnyOf`, `Rows`...
    accumulators: list[jax.Array]  # per leaf; rows as `(rows, k, ...)`
    weight: jax.Array  # the micro-batches' weights summed (0 without)
    weights: jax.Array | None  # each micro-batch's weight, `(k,)`, or None
    count: Any  # how many micro-batches ran (an int, or a traced int32)
    structs: list[jax.ShapeDtypeStruct]  # per leaf: output on one micro-batch
    treedef: Any  # the structure of the combined leaves
    static: PyTree  # the rest of the output (non-arrays, float0), as given
    carried: dict  # the NNX module leaves grad_fn sets, by index, after the loop


def is_float0(x: Any) -> bool:
    """Whether `x` (an array or a `ShapeDtypeStruct`) has dtype float0."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def is_combined(x: Any) -> bool:
    """An output leaf that `microbatched` combines: an array, not float0."""
    return eqx.is_array(x) and not is_float0(x)


def pcast_varying(tree: PyTree, axis_name: Hashable) -> PyTree:
    """Types every array of `tree` as differing across `axis_name`, so that
    `jax.grad` inside `shard_map` does not sum its gradient over devices."""

    def cast(x: Any) -> Any:
        axes = varying_axes(x) if isinstance(x, jax.Array) else None
        if axes is None:
            return x
        missing = tuple(n for n in manual_axes(axis_names(axis_name)) if n not in axes)
        return cast_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def _match_varying(tree: PyTree, like: PyTree) -> PyTree:
    """`tree` typed as varying wherever the carry `like` is."""

    def cast(value: jax.Array, like: jax.Array) -> jax.Array:
        want, have = varying_axes(like), varying_axes(value)
        if want is None or have is None or want <= have:
            return value
        return cast_varying(value, tuple(want - have))

    return jax.tree.map(cast, tree, like)


def _check_not_summed(outs: PyTree, kinds: list, acc: list, micro: Any, j: Any) -> None:
    """Refuses a float output that is the same on every device yet computed
    from grad_fn's arguments (which all vary): jax.grad summed it over them."""
    names, found = manual_axes(axis_names(micro.axis_name)), {}
    paths = jax.tree_util.tree_leaves_with_path(outs)
    for i, (kind, (path, out), a) in enumerate(zip(kinds, paths, acc, strict=True)):
        axes = varying_axes(out), varying_axes(a)
        same = () if None in axes else summed_axes(*axes, names)
        if isinstance(kind, Accumulator) and same:
            found[i] = path, same
    reads = micro.reads_arguments(j) if found else ()  # else a constant: averaged
    for path, same in (found[i] for i in found if reads[i]):
        along = same[0] if len(same) == 1 else same
        raise ValueError(
            f"microbatched: grad_fn's output at "
            f"{jax.tree_util.keystr(path) or 'the root'} is computed from its "
            f"arguments yet the same on every device along {along!r}: jax.grad "
            "summed it over the devices (grad_fn closes over what it "
            "differentiates), and averaging would scale it. Pass the params as "
            "arguments of grad_fn, given to the call: "
            "`microbatched(jax.grad(loss), k, batch_argnums=1)(params, batch)`."
        )


def is_gradient_mark(flag: Any) -> bool:
    """Whether `flag` is the `per_example` mark of a gradient w.r.t. the batch."""
    return isinstance(flag, str) and flag == "gradient"


def _per_example_flags(per_example: Any, out_shape: PyTree, shapes: PyTree) -> list:
    """`per_example` as one mark per array leaf of the output."""
    try:
        prefix = lambda f, sub: jax.tree.map(lambda _: f, sub)  # noqa: E731
        full = jax.tree.map(prefix, per_example, shapes)
    except ValueError as e:
        raise ValueError(
            "per_example must be a bool, 'gradient', or a pytree prefix of "
            "grad_fn's output with such leaves; grad_fn returned "
            f"{jax.tree.structure(out_shape)}, "
            f"per_example is {jax.tree.structure(per_example)}. ({e})"
        ) from None
    return [f if is_gradient_mark(f) else bool(f) for f in jax.tree.leaves(full)]


def _kind_and_dtype(struct: Any, flag: Any, micro: _MicroBatches, path: str) -> tuple:
    """How the output leaf at `path` is combined, and its accumulator's dtype."""
    settings, rows, where = micro.settings, micro.rows, f"at {path or 'the root'}"
    floating = Accumulator(settings.mean, settings.weight_fn is not None)
    if flag:
        if not struct.shape or struct.shape[0] != rows:
            raise ValueError(
                f"per_example marks grad_fn's output {where} as having a row per "
                f"example, but on a micro-batch of {rows} rows it has shape "
                f"{struct.shape}: its leading axis must be the micro-batch's rows."
            )
        if is_gradient_mark(flag):
            if not jnp.issubdtype(struct.dtype, jnp.inexact):
                raise TypeError(
                    f"per_example marks grad_fn's output {where} as "
                    f"'gradient', but it is {struct.dtype}: a gradient with "
                    "respect to the batch is floating."
                )
            return GradientRows(floating), struct.dtype
        return Rows(), struct.dtype
    if jnp.issubdtype(struct.dtype, jnp.inexact):
        names = (path, "microbatched", "grad_fn's output")
        acc_dtype = settings.accumulator_dtype
        return floating, accumulator_dtype_for(struct.dtype, acc_dtype, *names)
    if struct.dtype == jnp.bool_:
        return AnyOf(), jnp.dtype(jnp.bool_)
    if jnp.issubdtype(struct.dtype, jnp.integer):
        return Count(), struct.dtype
    raise TypeError(
        f"grad_fn returned {struct.dtype} {where}; microbatched combines "
        "floating (mean), integer (sum) and bool (any) outputs only."
    )


def _plan_outputs(
    out_shape: PyTree, micro: _MicroBatches
) -> tuple[list[Any], list[Any], list[Any], Any, PyTree]:
    """Per combined output leaf: kind, accumulator dtype, struct; treedef; the rest."""
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    combined = lambda x: is_struct(x) and not is_float0(x)  # noqa: E731
    shapes, static = eqx.partition(out_shape, combined, is_leaf=is_struct)
    # A float0 gradient comes back as the NumPy array jax.grad returns.
    as_numpy = lambda x: np.zeros(x.shape, x.dtype) if is_struct(x) else x  # noqa: E731
    static = jax.tree.map(as_numpy, static, is_leaf=is_struct)
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    flags = _per_example_flags(micro.settings.per_example, out_shape, shapes)
    planned = [
        _kind_and_dtype(s, flag, micro, jax.tree_util.keystr(path))
        for (path, s), flag in zip(flat_shapes, flags, strict=True)
    ]
    kinds, acc_dtypes = [k for k, _ in planned], [d for _, d in planned]
    return kinds, acc_dtypes, [s for _, s in flat_shapes], treedef, static


def _zero(kind: Any, struct: Any, dtype: Any, k: int) -> jax.Array:
    """A leaf's first carry: zeros (`(rows, k, ...)` for rows), typed as its output."""
    if not isinstance(kind, Rows):
        return zeros_like_struct(struct, dtype)
    shape = (struct.shape[0], k, *struct.shape[1:])
    if not sharded_type(struct):
        return jnp.zeros(shape, dtype)
    spec = tuple(struct.sharding.spec)
    spec += (None,) * (len(struct.shape) - len(spec))
    sharding = struct.sharding.update(spec=P(spec[0], None, *spec[1:]))
    return jnp.zeros(shape, dtype, out_sharding=sharding)


def _params_barrier(j: jax.Array, args: list, kwargs: dict, argnums: tuple) -> Any:
    """`args` and `kwargs` with their arrays outside the batch positions made
    to depend on `j`, so XLA cannot hoist their gathers out of the loop."""
    others = {i: a for i, a in enumerate(args) if i not in argnums}
    dynamic, static = eqx.partition((others, kwargs), eqx.is_array)
    dynamic, _ = lax.optimization_barrier((dynamic, j))
    others, kwargs = eqx.combine(dynamic, static)
    return [others.get(i, a) for i, a in enumerate(args)], kwargs


def _loop_bound(value: Any, k: int) -> Any:
    if value is None:
        return k
    if isinstance(value, int | np.integer):
        return int(value)
    return jnp.clip(jnp.asarray(value).astype(jnp.int32), 0, k)


class _MicroBatches:
    """Micro-batch `j`'s arguments, and `grad_fn` and `weight_fn` on them."""

    def __init__(self, settings, axis_name, args, kwargs, regather):
        k, argnums = settings.num_microbatches, settings.batch_argnums
        if axis_name is not None:
            args, kwargs = pcast_varying((args, kwargs), axis_name)
        size = jnp.shape(jax.tree.leaves(args[argnums[0]])[0])[0]  # on this device
        if size % k:
            raise ValueError(
                f"each device holds {size} rows of the batch (argument "
                f"{argnums[0]}), which do not split into num_microbatches={k} "
                f"equal micro-batches; the batch size must be a multiple of {k} "
                "times the number of devices it is sharded over."
            )
        self.rows = size // k
        split = lambda x: split_leading(x, k)  # noqa: E731
        self.split = {i: jax.tree.map(split, args[i]) for i in argnums}
        key = settings.key_argnum
        self.keys = None if key is None else jax.random.split(args[key], k)
        self.settings, self.axis_name, self.regather = settings, axis_name, regather
        self.args, self.kwargs = args, kwargs

    def cut(self, j: jax.Array) -> tuple[list, dict[str, Any]]:
        argnums, key_argnum = self.settings.batch_argnums, self.settings.key_argnum
        args, kwargs = list(self.args), self.kwargs
        if self.regather:
            args, kwargs = _params_barrier(j, args, kwargs, argnums)
        take = lambda x: lax.dynamic_index_in_dim(x, j, 1, False)  # noqa: E731
        for i in argnums:
            args[i] = jax.tree.map(take, self.split[i])
        if self.keys is not None and key_argnum is not None:
            key = lax.dynamic_index_in_dim(self.keys, j, keepdims=False)
            if self.axis_name is not None:  # each device's own dropout masks
                key = jax.random.fold_in(key, lax.axis_index(self.axis_name))
            args[key_argnum] = key
        return args, kwargs

    def call(self, j: Any, carried: Any = None, fn: Any = None, cut: Any = None) -> Any:
        """`grad_fn` (or `fn`) on micro-batch `j` (or the arguments `cut`), and
        the module leaves it sets, from `carried` (see `ModuleCarry.call`)."""
        args, kwargs = cut or self.cut(j)
        fn, modules = fn or self.settings.grad_fn, self.settings.modules
        if modules is None:
            return fn(*args, **kwargs), {}
        return modules.call(fn, tuple(args), kwargs, carried)

    def reads_arguments(self, j: jax.Array) -> list[bool]:
        """Per combined output leaf: whether grad_fn's jaxpr reads the arguments."""
        dynamic, static = eqx.partition(self.cut(j), eqx.is_array)
        run = lambda d: self.call(j, {}, None, eqx.combine(d, static))[0]
        jaxpr = jax.make_jaxpr(lambda d: eqx.filter(run(d), is_combined))(dynamic)
        live = {id(v) for v in jaxpr.jaxpr.invars}
        for eqn in jaxpr.jaxpr.eqns:
            if any(id(v) in live for v in eqn.invars):
                live.update(id(v) for v in eqn.outvars)
        return [id(v) in live for v in jaxpr.jaxpr.outvars]

    def weight(self, j: jax.Array, carried: dict) -> jax.Array:
        """`weight_fn` on micro-batch `j`, checked."""
        assert self.settings.weight_fn is not None
        weight = self.call(j, carried, self.settings.weight_fn)[0]
        if not is_real_scalar(weight):
            raise TypeError(
                "weight_fn must return a real scalar >= 0 (the micro-batch's "
                "weight, e.g. its number of non-padding tokens), got "
                f"{describe_value(weight)}."
            )
        return jnp.asarray(weight)


def _body(micro, kinds, dtype, j, carry):
    """Micro-batch `j`'s outputs, by their kinds, and weight folded into the carry."""
    acc, weight_sum, weights, carried = carry
    axis_name, settings = micro.axis_name, micro.settings
    terms: Weights | None = None
    if settings.weight_fn is not None:
        w = micro.weight(j, carried).astype(dtype)
        terms = Accumulator(settings.mean, True).weigh(weight_sum, w)
        weight_sum = terms.total
        weights = lax.dynamic_update_index_in_dim(weights, w, j, axis=0)
    out, changed = micro.call(j, carried)
    cast = lambda c, o: lax.convert_element_type(c, jnp.result_type(o))  # noqa: E731
    changed = jax.tree.map(cast, changed, carried)
    combined = eqx.filter(out, is_combined)
    outs = jax.tree.leaves(combined)
    if len(outs) != len(acc):
        raise ValueError(
            "grad_fn returned a different structure on its second trace: "
            f"{len(outs)} arrays against {len(acc)}."
        )
    new = [k.fold(o, a, j, terms) for k, o, a in zip(kinds, outs, acc, strict=True)]
    if axis_name is not None:  # unweighted, `weight_sum` and `weights` are `carry`'s
        _check_not_summed(combined, kinds, acc, micro, j)
        new, weight_sum, weights = _match_varying((new, weight_sum, weights), carry[:3])
    return new, weight_sum, weights, changed


def accumulate(
    settings: LoopSettings,
    axis_name: Hashable | None,
    args: tuple,
    kwargs: dict,
    *,
    regather: bool = False,
) -> Looped:
    """The loop on this device's rows."""
    k = settings.num_microbatches
    micro = _MicroBatches(settings, axis_name, args, kwargs, regather)
    out_shape, changed = eqx.filter_eval_shape(micro.call, jnp.int32(0))
    modules = settings.modules
    carried = {} if modules is None else modules.initial(micro, changed)
    kinds, acc_dtypes, structs, treedef, static = _plan_outputs(out_shape, micro)
    floating = zip(acc_dtypes, kinds, strict=True)
    dtype = weight_dtype([d for d, kind in floating if isinstance(kind, Accumulator)])
    weighted = settings.weight_fn is not None
    acc = [_zero(*x, k) for x in zip(kinds, structs, acc_dtypes, strict=True)]
    acc = acc if axis_name is None else pcast_varying(acc, axis_name)
    weight_sum, weights = jnp.zeros((), dtype), jnp.zeros((k,), dtype)
    if axis_name is not None and weighted:
        weight_sum, weights = pcast_varying((weight_sum, weights), axis_name)
    init = acc, weight_sum, weights, carried
    bound = _loop_bound(settings.num_real_microbatches, k)
    acc, weight_sum, weights, carried = lax.fori_loop(
        0, bound, lambda j, carry: _body(micro, kinds, dtype, j, carry), init
    )
    weights = weights if weighted else None
    looped = kinds, acc, weight_sum, weights, bound, structs, treedef, static
    return Looped(*looped, carried)
