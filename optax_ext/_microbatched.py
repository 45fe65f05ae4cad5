"""`microbatched`: gradient accumulation inside one compiled step.

`microbatched(grad_fn, k)` wraps a gradient function (`jax.grad`,
`jax.value_and_grad`, `eqx.filter_grad`, ...) and returns one with the same
signature that loops over `k` micro-batches of its batch argument in a
`lax.fori_loop` and returns the mean. It is the in-step form of gradient
accumulation, beside the optimizer form `MultiSteps`: one call, one
optimizer step, metrics and schedules per global batch, and compiled memory
of one micro-batch plus one gradient-sized accumulator. `weight_fn` makes it
a weighted mean (a token-mean loss over padded micro-batches);
`per_example` and `num_real_microbatches` are optax.microbatching's CONCAT
and ragged last batch.

Sharding is part of the contract. Micro-batch `j` is the rows `j, j + k,
j + 2k, ...` of the batch: with the batch sharded over a data axis, every
device holds its share of every micro-batch, so no rows move between
devices. Each device accumulates its own gradients and they are averaged
across devices once, after the loop: inside `jax.shard_map` with
`axis_name`, by a `pmean` after the loop; under `jax.jit` with a batch
sharded over `Explicit` mesh axes (found from its type), or over an `Auto`
axis named by `axis_name`, the loop runs inside a `jax.shard_map` over that
axis that this module adds; with params split over the batch's axes (FSDP),
under XLA's partitioner, which gathers them per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._sharding import (
    cast_varying,
    sharded_type,
    shards_over,
    split_leading,
    typed_sharding,
    varying_axes,
    zeros_like_struct,
)
from ._tree import (
    as_index,
    check_accumulator_dtype,
    describe_value,
    is_typed_key,
    widen,
    work_dtype,
)


def _check_num_microbatches(num_microbatches: Any) -> int:
    k = as_index(num_microbatches)
    if k is not None and k >= 1:
        return k
    raise ValueError(
        "num_microbatches must be a positive int (how many micro-batches the "
        f"batch is split into), got {num_microbatches!r} of type "
        f"{type(num_microbatches).__name__}."
    )


def _check_argnums(
    batch_argnums: Any, key_argnum: Any
) -> tuple[tuple[int, ...], int | None]:
    def index(value: Any, name: str) -> int:
        i = as_index(value)
        if i is not None and i >= 0:
            return i
        raise TypeError(
            f"{name} must be a non-negative int (a position in grad_fn's "
            f"arguments), got {value!r} of type {type(value).__name__}."
        )

    if isinstance(batch_argnums, Sequence) and not isinstance(batch_argnums, str):
        if not batch_argnums:
            raise ValueError("batch_argnums must name at least one argument, got ().")
        argnums = tuple(index(a, "batch_argnums") for a in batch_argnums)
    else:
        argnums = (index(batch_argnums, "batch_argnums"),)
    if len(set(argnums)) != len(argnums):
        raise ValueError(f"batch_argnums has repeated positions: {batch_argnums!r}.")
    key = None if key_argnum is None else index(key_argnum, "key_argnum")
    if key is not None and key in argnums:
        raise ValueError(
            f"key_argnum={key} is also in batch_argnums={argnums}: the key is "
            "split per micro-batch, not sliced like the batch."
        )
    return argnums, key


def _is_one_key(x: Any) -> bool:
    """One PRNG key: a typed one of shape (), or a raw `PRNGKey` (uint32 (2,))."""
    if is_typed_key(x):
        return jnp.ndim(x) == 0
    return getattr(x, "dtype", None) == jnp.uint32 and jnp.shape(x) == (2,)


def _batch_size(args: tuple, argnums: tuple[int, ...], k: int) -> int:
    """The common leading size of every batch leaf; checks it splits in `k`."""
    size, first = None, None
    for i in argnums:
        leaves = jax.tree_util.tree_flatten_with_path(args[i])[0]
        if not leaves:
            raise ValueError(
                f"argument {i} (in batch_argnums) holds no arrays: it must be "
                "the batch, a pytree of arrays with a leading batch axis."
            )
        for path, x in leaves:
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            shape = jnp.shape(x)
            if not shape:
                raise ValueError(
                    f"{where} is a scalar; every leaf of the batch needs a "
                    "leading batch axis to split into micro-batches."
                )
            if size is None:
                size, first = shape[0], where
            elif shape[0] != size:
                raise ValueError(
                    f"the batch leaves differ in their leading (batch) size: "
                    f"{first} has {size} rows, {where} has {shape[0]}."
                )
    assert size is not None
    if size % k:
        raise ValueError(
            f"the batch at {first} has {size} rows, which does not "
            f"split into num_microbatches={k} equal micro-batches; pass a batch "
            f"whose size is a multiple of {k}."
        )
    return size


def _batch_spec(args: tuple, argnums: tuple[int, ...]) -> Any:
    """The mesh axes the batch's leading dimension is sharded over, where that
    is part of its type (`Explicit` axes); None otherwise."""
    specs = set()
    mesh = None
    for i in argnums:
        for x in jax.tree.leaves(args[i]):
            sharding = typed_sharding(x)
            if sharding is None:
                specs.add(None)
                continue
            specs.add(sharding.spec[0])
            mesh = sharding.mesh
    if len(specs) != 1:
        return None, None
    (spec,) = specs
    return (None, None) if spec is None else (spec, mesh)


def _is_manual(axis_name: Hashable) -> bool:
    """Whether `axis_name` is bound here as a collective axis: inside
    `jax.shard_map` over it (or `vmap`/`pmap` with that name)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)
    if mesh.axis_names and all(n in mesh.axis_names for n in names):
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        return all(types[n] == AxisType.Manual for n in names)
    try:
        lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _is_float0(x: Any) -> bool:
    """Whether `x` (an array or a `ShapeDtypeStruct`) has dtype float0: what
    `jax.grad(..., allow_int=True)` gives for an integer input. It holds no
    values: `microbatched` returns it as `grad_fn` gives it."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _is_value(x: Any) -> bool:
    """An output leaf that `microbatched` combines: an array, not float0."""
    return eqx.is_array(x) and not _is_float0(x)


def _acc_dtype(dtype: Any, accumulator_dtype: Any, path: str) -> Any:
    if accumulator_dtype is None:
        return dtype
    promoted = jnp.promote_types(dtype, accumulator_dtype)
    if promoted == accumulator_dtype or accumulator_dtype == jnp.float32:
        # float32, the default, means "at least float32": float64 (x64) and
        # complex outputs accumulate in their own precision.
        return promoted
    raise ValueError(
        f"accumulator_dtype={accumulator_dtype} is narrower than grad_fn's "
        f"output {path} of dtype {dtype}: accumulating it there would round "
        "every micro-batch's contribution. Pass float32 (the default, which "
        "keeps wider outputs in their own dtype), a dtype at least as wide "
        "as every output, or None to accumulate each output in its own dtype."
    )


def _pcast_varying(tree: PyTree, axis_name: Hashable) -> PyTree:
    """Types every array of `tree` as differing across `axis_name`, so that
    `jax.grad` inside `shard_map` returns this device's own gradient instead
    of summing it over the devices (in every micro-batch)."""

    def cast(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        axes = varying_axes(x)
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        missing = tuple(n for n in names if axes is None or n not in axes)
        if axes is None or not missing:
            return x
        return cast_varying(x, missing)

    return jax.tree.map(cast, tree)


class _Options(NamedTuple):
    """What `microbatched` does beyond the plain mean: see its docstring."""

    weight_fn: Callable | None = None
    per_example: Any = False
    num_real_microbatches: Any = None


def _check_weight(weight: Any) -> jax.Array:
    dtype = getattr(weight, "dtype", None)
    if (
        dtype is None
        and isinstance(weight, int | float)
        and not isinstance(weight, bool)
    ):
        dtype = jnp.result_type(weight)
    real = dtype is not None and (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    )
    if not real or dtype == jnp.bool_ or jnp.shape(weight) != ():
        raise TypeError(
            "weight_fn must return a real scalar >= 0 (the micro-batch's "
            "weight, e.g. its number of non-padding tokens), got "
            f"{describe_value(weight)}."
        )
    return jnp.asarray(weight)


def _weight_dtype(acc_dtypes: list, kinds: list) -> Any:
    """float32, or float64 where a floating output accumulates in float64
    or complex128."""
    for dtype, kind in zip(acc_dtypes, kinds, strict=True):
        if kind == "mean" and jnp.dtype(dtype) in (
            jnp.dtype("float64"),
            jnp.dtype("complex128"),
        ):
            return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def _per_example_flags(per_example: Any, out_shape: PyTree, shapes: PyTree) -> list:
    """`per_example` (a bool, or a pytree prefix of grad_fn's output with
    bool leaves) as one flag per array leaf of the output."""
    if isinstance(per_example, bool):
        return [per_example] * len(jax.tree.leaves(shapes))
    try:
        full = jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: flag, sub), per_example, shapes
        )
    except ValueError as e:
        raise ValueError(
            "per_example must be a bool or a pytree prefix of grad_fn's output "
            f"with bool leaves; grad_fn returned {jax.tree.structure(out_shape)}, "
            f"per_example is {jax.tree.structure(per_example)}. ({e})"
        ) from None
    flags = jax.tree.leaves(full)
    for flag in flags:
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(
                f"per_example's leaves must be True or False, got {flag!r}."
            )
    return [bool(f) for f in flags]


def _check_num_real(value: Any, k: int) -> Any:
    """`num_real_microbatches`: None, or an int scalar; from 0 to `k` where
    known (a traced one is clipped to that range)."""
    if value is None:
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = None if isinstance(value, bool) else jnp.result_type(value)
    if (
        dtype is None
        or not jnp.issubdtype(dtype, jnp.integer)
        or jnp.shape(value) != ()
        or isinstance(value, bool)
    ):
        raise TypeError(
            "num_real_microbatches must be None or an int scalar (how many "
            "of the micro-batches hold real data), got "
            f"{describe_value(value)}."
        )
    try:
        known = int(np.asarray(value))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return value
    if not 0 <= known <= k:
        raise ValueError(
            f"num_real_microbatches must be from 0 to num_microbatches={k}, "
            f"got {known}."
        )
    return value


def _loop_bound(value: Any, k: int) -> Any:
    if value is None:
        return k
    if isinstance(value, int | np.integer):
        return int(value)
    return jnp.clip(jnp.asarray(value).astype(jnp.int32), 0, k)


def _unsplit(acc: jax.Array) -> jax.Array:
    """A per-example output's carry `(rows, k, ...)` as the batch's rows:
    micro-batch `j`'s row `a` is the batch's row `a * k + j`."""
    return acc.reshape(acc.shape[0] * acc.shape[1], *acc.shape[2:])


def _rows_accumulator(struct: Any, k: int, dtype: Any) -> jax.Array:
    """Zeros for a per-example output's `k` micro-batches, `(rows, k, ...)`:
    where the output's type is sharded (`Explicit` axes), its rows keep
    their split and the new micro-batch axis is whole."""
    shape = (struct.shape[0], k, *struct.shape[1:])
    if not sharded_type(struct):
        return jnp.zeros(shape, dtype)
    spec = tuple(struct.sharding.spec)
    spec += (None,) * (len(struct.shape) - len(spec))
    sharding = struct.sharding.update(spec=P(spec[0], None, *spec[1:]))
    return jnp.zeros(shape, dtype, out_sharding=sharding)


def _finish_weighted(
    kinds: list,
    acc: list,
    total: jax.Array,
    flat_shapes: list,
    axis_name: Hashable | None,
) -> list:
    """The weighted loop's results: floating ones are each device's weighted
    mean (zeros where its weights sum to 0); across devices, every device's
    mean times its weight, its integer sums, bool flags and its weight go
    into one `psum`, and the means are divided by the summed weight."""
    if axis_name is not None:
        parts = []
        for kind, a in zip(kinds, acc, strict=True):
            if kind == "mean":
                # At least the weight's float32: a narrower accumulator's
                # mean times a token count would overflow.
                wide = a.astype(jnp.promote_types(a.dtype, total.dtype))
                parts.append(wide * total.astype(wide.dtype))
            elif kind == "any":
                parts.append(a.astype(jnp.int32))
            elif kind == "sum":
                parts.append(a)
            else:
                parts.append(None)
        reduced = [p for p in parts if p is not None]
        summed, total = lax.psum((reduced, total), axis_name)
        it = iter(summed)
        safe = jnp.where(total > 0, total, jnp.ones_like(total))
        new = []
        for kind, a in zip(kinds, acc, strict=True):
            if kind == "concat":
                new.append(a)
                continue
            value = next(it)
            if kind == "mean":
                value = value / safe.astype(value.dtype)
            elif kind == "any":
                value = value > 0
            new.append(value)
        acc = new
    results = []
    for kind, a, (_, s) in zip(kinds, acc, flat_shapes, strict=True):
        results.append(_unsplit(a) if kind == "concat" else a.astype(s.dtype))
    return results


def _accumulate(
    grad_fn: Callable,
    k: int,
    argnums: tuple[int, ...],
    key_argnum: int | None,
    accumulator_dtype: Any,
    options: _Options,
    axis_name: Hashable | None,
    args: tuple,
    kwargs: dict,
    concat_kinds: list | None = None,
    *,
    regather: bool = False,
) -> PyTree:
    """The loop, on this device's rows; with `axis_name` bound, one reduction
    across it after the loop. `options` holds `weight_fn`, `per_example` and
    `num_real_microbatches`; where `concat_kinds` is a list, it gets which
    output leaves are per-example ones (for `_in_shard_map`'s out_specs).
    With `regather`, everything but the batch passes an
    `optimization_barrier` with the micro-batch index in each iteration, so
    that XLA cannot hoist what it computes from the params (the all-gathers
    of sharded params) out of the loop: gathered there, the whole model
    stayed live through the loop (1.5x the full batch's temporary memory,
    `docs/design.md`)."""
    if axis_name is not None:
        args, kwargs = _pcast_varying((args, kwargs), axis_name)
    size = jnp.shape(jax.tree.leaves(args[argnums[0]])[0])[0]
    if size % k:
        raise ValueError(
            f"each device holds {size} rows of the batch (argument "
            f"{argnums[0]}), which do not split into num_microbatches={k} "
            f"equal micro-batches; the batch size must be a multiple of {k} "
            "times the number of devices it is sharded over."
        )
    # Rows (a * k + j) form micro-batch j: the reshape splits the batch axis
    # with the micro-batch index as the minor part, so a device's rows stay
    # its own in every micro-batch (the major split moved rows between them).
    split = {i: jax.tree.map(lambda x: split_leading(x, k), args[i]) for i in argnums}
    keys = None
    if key_argnum is not None:
        keys = jax.random.split(args[key_argnum], k)

    def cut(j: jax.Array) -> tuple[list, dict[str, Any]]:
        call_args = list(args)
        call_kwargs = kwargs
        if regather:
            call_args, call_kwargs = _varying_with(j, (call_args, kwargs), argnums)
        for i in argnums:
            call_args[i] = jax.tree.map(
                lambda x: lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False),
                split[i],
            )
        if keys is not None and key_argnum is not None:
            key = lax.dynamic_index_in_dim(keys, j, keepdims=False)
            if axis_name is not None:
                # Each device's rows get their own dropout masks.
                key = jax.random.fold_in(key, lax.axis_index(axis_name))
            call_args[key_argnum] = key
        return call_args, call_kwargs

    def call(j: jax.Array) -> PyTree:
        call_args, call_kwargs = cut(j)
        return grad_fn(*call_args, **call_kwargs)

    def weight_of(j: jax.Array) -> jax.Array:
        assert options.weight_fn is not None
        call_args, call_kwargs = cut(j)
        return _check_weight(options.weight_fn(*call_args, **call_kwargs))

    out_shape = eqx.filter_eval_shape(call, jnp.zeros((), jnp.int32))
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    is_combined = lambda x: is_struct(x) and not _is_float0(x)  # noqa: E731
    shapes, static = eqx.partition(out_shape, is_combined, is_leaf=is_struct)
    # A float0 gradient (of an integer input) holds no values: it comes back
    # as the NumPy array of its shape that jax.grad returns.
    static = jax.tree.map(
        lambda x: np.zeros(x.shape, x.dtype) if is_struct(x) else x,
        static,
        is_leaf=is_struct,
    )
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rows = size // k
    flags = _per_example_flags(options.per_example, out_shape, shapes)
    kinds, acc_dtypes = [], []
    for (path, s), per_example in zip(flat_shapes, flags, strict=True):
        name = f"at {jax.tree_util.keystr(path) or 'the root'}"
        if per_example:
            if not s.shape or s.shape[0] != rows:
                raise ValueError(
                    f"per_example marks grad_fn's output {name} as having a "
                    f"row per example, but on a micro-batch of {rows} rows it "
                    f"has shape {s.shape}: its leading axis must be the "
                    "micro-batch's rows."
                )
            kinds.append("concat")
            acc_dtypes.append(s.dtype)
        elif jnp.issubdtype(s.dtype, jnp.inexact):
            kinds.append("mean")
            acc_dtypes.append(_acc_dtype(s.dtype, accumulator_dtype, name))
        elif s.dtype == jnp.bool_:
            kinds.append("any")
            acc_dtypes.append(jnp.bool_)
        elif jnp.issubdtype(s.dtype, jnp.integer):
            kinds.append("sum")
            acc_dtypes.append(s.dtype)
        else:
            raise TypeError(
                f"grad_fn returned {s.dtype} {name}; microbatched combines "
                "floating (mean), integer (sum) and bool (any) outputs only."
            )

    weighted = options.weight_fn is not None
    weight_dtype = _weight_dtype(acc_dtypes, kinds)

    def combine(kind: str, j: jax.Array, out: jax.Array, acc: jax.Array, fold):
        if kind == "concat":
            return lax.dynamic_update_index_in_dim(acc, out, j, axis=1)
        out = widen(out, acc.dtype)
        if kind == "sum":
            return acc + out
        if kind == "any":
            return jnp.logical_or(acc, out)
        if fold is not None:
            # MultiSteps' weighted running mean (`_weighted.fold_weighted`): a
            # weight-0 micro-batch's outputs, NaN ones included, leave none.
            first, nothing, scale = fold
            running = acc + (out - acc) / scale.astype(acc.dtype)
            return jnp.where(nothing, acc, jnp.where(first, out, running))
        # The running mean of MultiSteps, so both forms give the same bits on
        # the same micro-batches; the first one is selected (no 0 * inf).
        running = acc + (out - acc) / (j + 1).astype(acc.dtype)
        return jnp.where(j == 0, out, running)

    def body(j: jax.Array, carry: tuple) -> tuple:
        acc, total = carry
        fold = None
        if weighted:
            w = weight_of(j).astype(weight_dtype)
            new_total = total + w
            nothing = w == 0
            scale = new_total / jnp.where(nothing, jnp.ones_like(w), w)
            fold = (total == 0, nothing, scale)
            total = new_total
        dynamic = eqx.filter(call(j), _is_value)
        outs = jax.tree.leaves(dynamic)
        if len(outs) != len(acc):
            raise ValueError(
                "grad_fn returned a different structure on its second trace: "
                f"{len(outs)} arrays against {len(acc)}."
            )
        new = []
        for kind, out, a in zip(kinds, outs, acc, strict=True):
            value = combine(kind, j, out, a, fold)
            if axis_name is not None:
                value = _match_varying(value, a)
            new.append(value)
        if axis_name is not None and weighted:
            total = _match_varying(total, carry[1])
        return new, total

    init = []
    for (_, s), dtype, kind in zip(flat_shapes, acc_dtypes, kinds, strict=True):
        if kind == "concat":
            zero = _rows_accumulator(s, k, dtype)
        else:
            # With the output's sharding where its type has one (params
            # sharded over `Explicit` axes): a sharded accumulator.
            zero = zeros_like_struct(s, dtype)
        if axis_name is not None:
            zero = _pcast_varying(zero, axis_name)
        init.append(zero)
    total = jnp.zeros((), weight_dtype)
    if axis_name is not None and weighted:
        total = _pcast_varying(total, axis_name)
    acc, total = lax.fori_loop(
        0, _loop_bound(options.num_real_microbatches, k), body, (init, total)
    )
    if concat_kinds is not None:
        concat_kinds.extend(kind == "concat" for kind in kinds)
    if weighted:
        return eqx.combine(
            jax.tree_util.tree_unflatten(
                treedef, _finish_weighted(kinds, acc, total, flat_shapes, axis_name)
            ),
            static,
        )

    results = []
    for kind, a, (_, s) in zip(kinds, acc, flat_shapes, strict=True):
        if kind == "concat":
            results.append(_unsplit(a))
            continue
        if axis_name is not None:
            # The one reduction across devices: each device's mean (or sum)
            # over its micro-batches, in the accumulator's dtype (float32
            # for a narrower one, whose sum over devices would overflow).
            if kind == "mean":
                a = lax.pmean(a.astype(work_dtype(a.dtype)), axis_name)
            elif kind == "sum":
                a = lax.psum(a, axis_name)
            else:
                a = lax.psum(a.astype(jnp.int32), axis_name) > 0
        results.append(a.astype(s.dtype))
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, results), static)


def _varying_with(j: jax.Array, tree: Any, argnums: tuple[int, ...]) -> Any:
    """`(args, kwargs)` as they are, but their arrays outside the batch
    positions made to depend on `j` for XLA (an `optimization_barrier`)."""
    args, kwargs = tree
    others = {i: a for i, a in enumerate(args) if i not in argnums}
    dynamic, static = eqx.partition((others, kwargs), eqx.is_array)
    dynamic, _ = lax.optimization_barrier((dynamic, j))
    others, kwargs = eqx.combine(dynamic, static)
    return [others.get(i, a) for i, a in enumerate(args)], kwargs


def _match_varying(value: jax.Array, like: jax.Array) -> jax.Array:
    """`value` typed as varying wherever the carry `like` is (a loop carry
    keeps its type)."""
    want, have = varying_axes(like), varying_axes(value)
    if want is None or have is None or want <= have:
        return value
    return cast_varying(value, tuple(want - have))


def microbatched(
    grad_fn: Callable,
    num_microbatches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    key_argnum: int | None = None,
    accumulator_dtype: Any = jnp.float32,
    axis_name: Hashable | None = None,
    weight_fn: Callable | None = None,
    per_example: Any = False,
    num_real_microbatches: int | jax.Array | None = None,
) -> Callable:
    """Computes `grad_fn` on a batch one micro-batch at a time, in one
    compiled loop, and returns its mean: the in-step form of gradient
    accumulation.

    `microbatched(grad_fn, k)(*args)` returns what `grad_fn(*args)` returns
    on the whole batch, with the activation memory of `1/k` of it: the batch
    argument (a pytree of arrays sharing a leading batch axis) is cut into `k`
    micro-batches, `grad_fn` is called on each inside a `lax.fori_loop` (not
    unrolled: `grad_fn` is traced twice, once for its output's shapes and
    once for the loop's body), and the outputs are combined leaf by leaf:

    - floating leaves (gradients, loss values, float aux) are averaged over
      the micro-batches. This is the whole batch's value when the loss is a
      **mean over the batch's rows** (a sum would come back `k` times too
      small; a weighted mean, with weights that differ between
      micro-batches, is not a mean of micro-batch means);
    - integer leaves are summed (counts such as the number of correct
      predictions), bool leaves are `any`-ed (flags such as "found a NaN");
    - leaves that are not arrays (an Equinox model's activation functions,
      `None` gradients) and float0 leaves (the gradients of integer inputs
      that `jax.grad(..., allow_int=True)` gives) are returned as `grad_fn`
      gives them.

    With `weight_fn`, floating leaves are combined as
    `sum_j w_j x_j / sum_j w_j` instead, `w_j` micro-batch `j`'s weight: for
    a loss that is a mean over the batch's non-padding tokens, with `w_j`
    the micro-batch's token count, that is the whole batch's loss and
    gradient (integer leaves are still summed, bool ones `any`-ed).

    An output with a row per example (per-example losses as aux, gradients
    with respect to the batch itself) is averaged element by element like
    any floating leaf, unless `per_example` marks it: then it comes back
    whole, each row where the batch has it (optax.microbatching's CONCAT).

    Micro-batch `j` is the rows `j, j + k, j + 2k, ...` of the batch.
    Keyword arguments are passed to every call unchanged.

    **Numerics:** floating outputs are kept as a running mean,
    `acc + (g - acc) / (j + 1)` with the first micro-batch's value selected,
    the same as `MultiSteps`' (with the same float32 or wider accumulator
    the two give the same bits on the same micro-batches; with
    `accumulator_dtype=None` a bfloat16 or float16 mean is computed in its
    own dtype here, in float32 and rounded once per mini-step there), in
    `promote_types(dtype, accumulator_dtype)`: float32
    for bfloat16 and float16 outputs, their own dtype for float64 and
    complex ones. A bfloat16 output is folded as the bfloat16 value it is,
    even where XLA fuses its computation into the fold (and would skip the
    rounding). They come back in `grad_fn`'s own dtypes. NaN and `inf`
    in one micro-batch make the mean NaN or `inf`, as on the whole batch.

    **Sharding:** with the batch sharded over a data axis, every device holds
    its rows of every micro-batch, accumulates its own gradients, and they
    are averaged across devices once, after the loop:

    - inside `jax.shard_map`, pass `axis_name`: the arguments are typed as
      differing across it (`lax.pcast`), so `jax.grad` in `grad_fn` gives
      this device's own gradients, and the floating outputs are `pmean`-ed
      after the loop (integer ones `psum`-ed). `grad_fn` is written for
      this device's rows, as on one device; the result is the gradient of
      the mean over all devices' rows;
    - under `jax.jit` with the batch sharded over `Explicit` mesh axes, the
      axes are read from the batch's type; with `Auto` axes pass
      `axis_name` and call it under `jax.set_mesh`. The loop then runs inside
      a `jax.shard_map` over those axes (other mesh axes stay as they are).
      The other arguments enter it replicated over the data axes: for
      params replicated over them (data parallelism);
    - with params split over the batch's axes (FSDP / ZeRO-3) under
      `Explicit` axes (read from their types), or under `Auto` axes without
      `axis_name`, the loop runs under XLA's partitioner, as the plain
      jitted gradient does: each micro-batch gathers the params as its
      forward pass needs them (never the whole model before the loop), and
      its gradients are reduce-scattered into an accumulator split as the
      params. With `Auto` axes the params' sharding is not in their type:
      `axis_name` there means params replicated over it, and sharded ones
      would be gathered whole before the loop, so leave it out.

    Without a sharded batch or `axis_name` the loop runs as it is (XLA
    chooses; with an `Auto` batch sharding it reduces the gradients once per
    micro-batch).

    **Arguments:**

    - `grad_fn`: the function to accumulate, e.g. `jax.grad(loss)` or
      `eqx.filter_value_and_grad(loss, has_aux=True)`. Its loss must be a
      mean over the batch's rows.
    - `num_microbatches`: a positive int `k` dividing the batch size (times
      the number of devices the batch is sharded over).
    - `batch_argnums`: the position (or positions) of the batch in
      `grad_fn`'s arguments; every leaf has the same leading size.
    - `key_argnum`: the position of a PRNG key (e.g. for dropout), or None.
      Micro-batch `j` gets `jax.random.split(key, k)[j]` (folded with the
      device index inside `shard_map`), so dropout masks differ from those
      of one call on the whole batch.
    - `accumulator_dtype`: the dtype floating outputs are accumulated in;
      float32 (the default) means at least float32. Any other dtype
      narrower than an output is refused with an error; `None` accumulates
      each output in its own dtype.
    - `axis_name`: the mesh axis (or tuple of axes) the batch is sharded
      over, where it is not in the batch's type (see Sharding).
    - `weight_fn`: None, or a function called like `grad_fn` (the batch cut
      to one micro-batch, the same other arguments) that returns that
      micro-batch's weight, a real scalar >= 0 (e.g.
      `lambda params, batch: batch["mask"].sum()`). Floating outputs are
      then the weighted mean, computed as `MultiSteps(weighted=True)` does
      (a weighted running mean; a micro-batch of weight 0 is not read, so
      its NaN loss does not spread); all weights 0 give zeros. Across
      devices each device's weighted mean and weight go into the one
      reduction after the loop, which divides by the summed weight. The
      weights are traced: negative ones are not caught.
    - `per_example`: `False` (the default), `True`, or a pytree prefix of
      `grad_fn`'s output with bool leaves: the outputs marked `True` have a
      row per example of the micro-batch (leading axis) and come back with a
      row per example of the whole batch, in the batch's order, not
      combined. With a sharded batch they stay sharded like it.
    - `num_real_microbatches`: None, or an int (a traced one too, e.g. the
      size of a ragged last batch, with no recompilation): only the first
      `n` micro-batches run (rows whose index mod `k` is below `n`, given
      the split above); the rest of the batch is never read. Means are over
      the real micro-batches; per-example rows of the others are zeros. A
      known value must be from 0 to `k`; a traced one is clipped to that
      range.

    **Returns:**

    A function with `grad_fn`'s signature.

    **Example:**

    ```python
    grad_fn = eqx.filter_value_and_grad(loss)
    step_grads = optax_ext.microbatched(grad_fn, num_microbatches=8)
    loss, grads = step_grads(model, batch)  # as grad_fn(model, batch)
    ```
    """
    if not callable(grad_fn):
        raise TypeError(
            f"grad_fn must be a function (e.g. jax.grad(loss)), got {grad_fn!r} "
            f"of type {type(grad_fn).__name__}."
        )
    k = _check_num_microbatches(num_microbatches)
    argnums, key_argnum = _check_argnums(batch_argnums, key_argnum)
    acc_dtype = check_accumulator_dtype(accumulator_dtype, complex_ok=False)
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(
            "weight_fn must be None or a function taking grad_fn's arguments "
            "(the batch cut to one micro-batch) and returning its weight, got "
            f"{describe_value(weight_fn)}."
        )
    if not isinstance(per_example, bool | np.bool_):
        jax.tree.map(lambda _: None, per_example)  # a pytree (checked on call)
    options = _Options(
        weight_fn,
        bool(per_example) if isinstance(per_example, bool | np.bool_) else per_example,
        _check_num_real(num_real_microbatches, k),
    )

    def wrapped(*args: Any, **kwargs: Any) -> PyTree:
        needed = max(argnums + ((key_argnum,) if key_argnum is not None else ()))
        if len(args) <= needed:
            raise TypeError(
                f"microbatched({getattr(grad_fn, '__name__', 'grad_fn')}) takes "
                f"the batch at positions {argnums}"
                + ("" if key_argnum is None else f" and the key at {key_argnum}")
                + f", but was called with {len(args)} positional arguments; "
                "pass them positionally."
            )
        _batch_size(args, argnums, k)
        if key_argnum is not None and not _is_one_key(args[key_argnum]):
            key = args[key_argnum]
            raise TypeError(
                f"argument {key_argnum} (key_argnum) must be a PRNG key "
                "(jax.random.key(...) or jax.random.PRNGKey(...)), got "
                f"{type(key).__name__} of shape {jnp.shape(key)} and dtype "
                f"{getattr(key, 'dtype', None)}."
            )
        run = functools.partial(
            _accumulate, grad_fn, k, argnums, key_argnum, acc_dtype, options
        )
        if axis_name is not None and _is_manual(axis_name):
            return run(axis_name, args, kwargs)
        spec, mesh = _batch_spec(args, argnums)
        if spec is None and axis_name is not None:
            mesh = jax.sharding.get_abstract_mesh()
            names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
            if not all(n in mesh.axis_names for n in names):
                raise ValueError(
                    f"microbatched(axis_name={axis_name!r}) needs that axis "
                    "bound: call it inside jax.shard_map over it, or under "
                    "jax.set_mesh(mesh) with a mesh that has it; the mesh "
                    f"here has axes {mesh.axis_names}."
                )
            spec = axis_name
        if spec is None or _shards_over_batch_axes(args, kwargs, argnums, spec):
            # The partitioner runs the loop: params sharded (or, with `Auto`
            # axes, maybe sharded) are gathered in each micro-batch.
            return run(None, args, kwargs, regather=jax.device_count() > 1)
        return _in_shard_map(run, mesh, spec, argnums, args, kwargs)

    # Name and docstring only: `functools.wraps` would also set `__wrapped__`,
    # which `eqx.filter_jit` takes for a JAX transform stored on a module.
    for attr in ("__name__", "__qualname__", "__doc__"):
        if hasattr(grad_fn, attr):
            setattr(wrapped, attr, getattr(grad_fn, attr))
    return wrapped


def _shards_over_batch_axes(args, kwargs, argnums, spec) -> bool:
    """Whether an argument other than the batch is split over the batch's
    mesh axes in its type (FSDP params): then the loop runs under the
    partitioner, which gathers the params as each micro-batch's forward
    pass needs them and reduce-scatters its gradients into the sharded
    accumulator, as for the plain jitted gradient (a `shard_map` over the
    batch's axes would gather the whole model first)."""
    others = [a for i, a in enumerate(args) if i not in argnums]
    return shards_over((others, kwargs), spec)


def _in_shard_map(
    run: Callable, mesh: Any, spec: Any, argnums: tuple[int, ...], args, kwargs
) -> PyTree:
    """Runs the loop inside a `jax.shard_map` manual over the batch's axes
    only: the batch enters split over them, everything else replicated."""
    axes = spec if isinstance(spec, tuple) else (spec,)
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    dyn_args, dyn_kwargs = dynamic
    in_specs = (
        tuple(P(spec) if i in argnums else P() for i in range(len(dyn_args))),
        P(),
    )
    out_static, out_def, concat_kinds = [], [], []

    def local(dyn_args, dyn_kwargs):
        args, kwargs = eqx.combine((dyn_args, dyn_kwargs), static)
        out = run(spec, tuple(args), kwargs, concat_kinds)
        dyn_out, static_out = eqx.partition(out, _is_value)
        out_static.append(static_out)
        leaves, treedef = jax.tree.flatten(dyn_out)
        out_def.append(treedef)
        # Per-example outputs keep each device's rows: split over the axes.
        reduced = [x for x, c in zip(leaves, concat_kinds, strict=True) if not c]
        rows = [x for x, c in zip(leaves, concat_kinds, strict=True) if c]
        return reduced, rows

    reduced, rows = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(P(), P(spec)),
        axis_names=set(axes),
    )(tuple(dyn_args), dyn_kwargs)
    reduced_it, rows_it = iter(reduced), iter(rows)
    leaves = [next(rows_it) if c else next(reduced_it) for c in concat_kinds]
    dyn_out = jax.tree.unflatten(out_def[0], leaves)
    return eqx.combine(dyn_out, out_static[0])
