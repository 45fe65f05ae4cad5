"""`microbatched`: gradient accumulation inside one compiled step.

`microbatched(grad_fn, k)` wraps a gradient function (`jax.grad`,
`jax.value_and_grad`, `eqx.filter_grad`, ...) and returns one with the same
signature that loops over `k` micro-batches of its batch argument in a
`lax.fori_loop` and returns the mean. It is the in-step form of gradient
accumulation, beside the optimizer form `MultiSteps`: one call, one
optimizer step, metrics and schedules per global batch, and compiled memory
of one micro-batch plus one gradient-sized accumulator.

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
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._sharding import (
    cast_varying,
    shards_over,
    split_leading,
    typed_sharding,
    varying_axes,
    zeros_like_struct,
)
from ._tree import as_index, check_accumulator_dtype, widen


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


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(x) == 0
    return dtype == jnp.uint32 and jnp.shape(x) == (2,)  # a raw PRNGKey


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


def _accumulate(
    grad_fn: Callable,
    k: int,
    argnums: tuple[int, ...],
    key_argnum: int | None,
    accumulator_dtype: Any,
    axis_name: Hashable | None,
    args: tuple,
    kwargs: dict,
    *,
    regather: bool = False,
) -> PyTree:
    """The loop, on this device's rows; with `axis_name` bound, one reduction
    across it after the loop. With `regather`, everything but the batch
    passes an `optimization_barrier` with the micro-batch index in each
    iteration, so that XLA cannot hoist what it computes from the params
    (the all-gathers of sharded params) out of the loop: gathered there,
    the whole model stayed live through the loop (1.5x the full batch's
    temporary memory, `docs/design.md`)."""
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

    def call(j: jax.Array) -> PyTree:
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
        return grad_fn(*call_args, **call_kwargs)

    out_shape = eqx.filter_eval_shape(call, jnp.zeros((), jnp.int32))
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    shapes, static = eqx.partition(out_shape, is_struct, is_leaf=is_struct)
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    kinds, acc_dtypes = [], []
    for path, s in flat_shapes:
        name = f"at {jax.tree_util.keystr(path) or 'the root'}"
        if jnp.issubdtype(s.dtype, jnp.inexact):
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

    def combine(kind: str, j: jax.Array, out: jax.Array, acc: jax.Array):
        out = widen(out, acc.dtype)
        if kind == "sum":
            return acc + out
        if kind == "any":
            return jnp.logical_or(acc, out)
        # The running mean of MultiSteps, so both forms give the same bits on
        # the same micro-batches; the first one is selected (no 0 * inf).
        running = acc + (out - acc) / (j + 1).astype(acc.dtype)
        return jnp.where(j == 0, out, running)

    def body(j: jax.Array, acc: list) -> list:
        dynamic, _ = eqx.partition(call(j), eqx.is_array)
        outs = jax.tree.leaves(dynamic)
        if len(outs) != len(acc):
            raise ValueError(
                "grad_fn returned a different structure on its second trace: "
                f"{len(outs)} arrays against {len(acc)}."
            )
        new = []
        for kind, out, a in zip(kinds, outs, acc, strict=True):
            value = combine(kind, j, out, a)
            if axis_name is not None:
                value = _match_varying(value, a)
            new.append(value)
        return new

    init = []
    for (_, s), dtype in zip(flat_shapes, acc_dtypes, strict=True):
        # With the output's sharding where its type has one (params
        # sharded over `Explicit` axes): a sharded accumulator.
        zero = zeros_like_struct(s, dtype)
        if axis_name is not None:
            zero = _pcast_varying(zero, axis_name)
        init.append(zero)
    acc = lax.fori_loop(0, k, body, init)

    results = []
    for kind, a, (_, s) in zip(kinds, acc, flat_shapes, strict=True):
        if axis_name is not None:
            # The one reduction across devices: each device's mean (or sum)
            # over its micro-batches, in the accumulator's dtype.
            if kind == "mean":
                a = lax.pmean(a, axis_name)
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
      `None` gradients) are returned as `grad_fn` gives them.

    An output with a row per example (per-example losses as aux, gradients
    with respect to the batch itself) is averaged element by element like
    any floating leaf, so it comes back with the rows of one micro-batch,
    each the mean of `k` examples: not its whole-batch value. Reduce such
    outputs over the rows inside `grad_fn`, or leave them out.

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
        if key_argnum is not None and not _is_key(args[key_argnum]):
            key = args[key_argnum]
            raise TypeError(
                f"argument {key_argnum} (key_argnum) must be a PRNG key "
                "(jax.random.key(...) or jax.random.PRNGKey(...)), got "
                f"{type(key).__name__} of shape {jnp.shape(key)} and dtype "
                f"{getattr(key, 'dtype', None)}."
            )
        run = functools.partial(_accumulate, grad_fn, k, argnums, key_argnum, acc_dtype)
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
    out_static = []

    def local(dyn_args, dyn_kwargs):
        args, kwargs = eqx.combine((dyn_args, dyn_kwargs), static)
        out = run(spec, tuple(args), kwargs)
        dyn_out, static_out = eqx.partition(out, eqx.is_array)
        out_static.append(static_out)
        return dyn_out

    dyn_out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=P(),
        axis_names=set(axes),
    )(tuple(dyn_args), dyn_kwargs)
    return eqx.combine(dyn_out, out_static[0])
