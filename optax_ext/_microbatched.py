"""`microbatched`: gradient accumulation inside one compiled step.

`microbatched(grad_fn, k)` wraps a gradient function and returns one with
the same signature that loops over `k` micro-batches of its batch argument
and returns the mean: the in-step form of gradient accumulation, beside the
optimizer form `MultiSteps`. This module holds the public function and the
checks of its arguments; the loop is `_microbatched_loop`'s, where it runs
and the reduction across devices `_microbatched_devices`'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._accumulate.arithmetic import check_accumulator_dtype
from ._leaves import is_typed_key
from ._microbatched_devices import run_on_devices
from ._microbatched_loop import LoopSettings, is_gradient_mark
from ._nnx_graph import merging, split_graph_nodes
from ._tree import as_index, describe_value


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


def _raw_key_impl() -> str:
    """The PRNG implementation a raw key (`jax.random.PRNGKey(...)`, a
    uint32 array) is read with: JAX's default, `jax_default_prng_impl`."""
    # The flag's value, context managers included (`jax.default_prng_impl`);
    # `jax.config`'s type does not declare its flags.
    return getattr(jax.config, "jax_default_prng_impl")  # noqa: B009


def _is_single_prng_key(x: Any) -> bool:
    """Whether `x` is one PRNG key, not a batch of keys: a typed one of
    shape (), or a raw one that its implementation (the default one) reads
    as a single key (uint32 `(2,)` for threefry, `(4,)` for rbg)."""
    if is_typed_key(x):
        return jnp.ndim(x) == 0
    if getattr(x, "dtype", None) != jnp.uint32:
        return False
    # A fresh callable each time: `eval_shape` caches traces by function,
    # and the default implementation is not part of that cache's key.
    wrap = functools.partial(jax.random.wrap_key_data, impl=_raw_key_impl())
    try:
        key = jax.eval_shape(wrap, jax.ShapeDtypeStruct(jnp.shape(x), jnp.uint32))
    except TypeError:  # key data of another implementation's shape
        return False
    return key.shape == ()


def _raw_key_shape() -> tuple[int, ...]:
    impl = _raw_key_impl()
    return jax.eval_shape(functools.partial(jax.random.PRNGKey, impl=impl), 0).shape


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


def _check_per_example(per_example: Any) -> Any:
    """`per_example`: True, False, `"gradient"`, or a pytree of them (its fit
    to grad_fn's output is checked on call)."""
    if isinstance(per_example, bool | np.bool_):
        return bool(per_example)
    marks = jax.tree.leaves(per_example)
    for mark in marks:
        if not (isinstance(mark, bool | np.bool_) or is_gradient_mark(mark)):
            raise TypeError(
                "per_example must be True, False, 'gradient', or a pytree "
                "prefix of grad_fn's output with such leaves (True: rows "
                "returned as they are; 'gradient': rows of a gradient with "
                "respect to the batch); got "
                f"{per_example!r}, whose leaf {mark!r} is none of them."
            )
    return per_example


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
    on the whole batch (for the losses and outputs described below), with
    the activation memory of `1/k` of it: the batch
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

    An output with a row per example is averaged element by element like
    any floating leaf unless `per_example` marks it; then it comes back with
    a row per example of the whole batch, each where the batch has it
    (optax.microbatching's CONCAT). What the rows are, `microbatched`
    cannot tell, so the mark says:

    - `True`: values of each example on its own (per-example losses as
      aux), returned as they are;
    - `"gradient"`: a gradient with respect to the batch itself
      (`jax.grad(loss, argnums=(0, 1))`). A micro-batch's mean loss weighs
      each of its rows by `k / N` where the whole batch's weighs it by
      `1 / N`, so micro-batch `j`'s rows are scaled by its share of the
      whole batch: `1 / k` (`1 / n` with `n` real micro-batches, and over
      `d` devices `1 / (n d)`), or `w_j / W` with `weight_fn` (`W` the sum
      of the weights; the rows of a micro-batch of weight 0 are zeros).
      Marked `True`, they would come back `k` (or `W / w_j`) times the
      whole batch's.

    Micro-batch `j` is the rows `j, j + k, j + 2k, ...` of the batch (so
    that with a sharded batch each device keeps its own rows in every
    micro-batch). For micro-batch `j` to be the contiguous rows
    `j N/k, ..., (j + 1) N/k - 1` instead, reorder each leaf before the
    call, `x.reshape(k, N // k, ...).swapaxes(0, 1).reshape(x.shape)`, and
    per-example outputs after it with the inverse,
    `y.reshape(N // k, k, ...).swapaxes(0, 1).reshape(y.shape)`.
    Keyword arguments are passed to every call unchanged.

    **Numerics:** floating outputs are kept as a running mean,
    `acc + (g - acc) / (j + 1)` with the first micro-batch's value selected,
    computed by the same function as `MultiSteps`' (`_accumulate.arithmetic.fold`),
    so the two give the same bits on the same micro-batches. Each output
    accumulates in the least dtype holding both its dtype and
    `accumulator_dtype` (`MultiSteps`' rule): float32 for bfloat16 and
    float16 outputs by default, their own dtype for float64 and complex
    ones. A bfloat16 or float16 accumulator (`accumulator_dtype=None`) is
    updated in float32 and rounded once per micro-batch. A bfloat16 output
    is folded as the bfloat16 value it is, even where XLA fuses its
    computation into the fold (and would skip the rounding). They come back
    in `grad_fn`'s own dtypes. NaN and `inf` in one micro-batch make the
    mean non-finite, as on the whole batch, but not always the same
    non-finite value: an `inf` folded before another micro-batch comes
    back NaN (`inf - inf` in the running mean), as in `optax.MultiSteps`,
    where the whole batch gives `inf`.

    **Sharding:** with the batch sharded over a data axis, every device holds
    its rows of every micro-batch, accumulates its own gradients, and they
    are averaged across devices once, after the loop:

    - inside `jax.shard_map`, pass `axis_name`: the arguments are typed as
      differing across it (`lax.pcast`), so `jax.grad` in `grad_fn` gives
      this device's own gradients, and the floating outputs are `pmean`-ed
      after the loop (integer ones `psum`-ed). `grad_fn` is written for
      this device's rows, as on one device; the result is the gradient of
      the mean over all devices' rows. It takes the params as an argument:
      a `grad_fn` closing over them (`jax.grad` would sum their gradient
      over the devices) is refused, here and with `Auto` axes;
    - under `jax.jit` with the batch sharded over `Explicit` mesh axes, the
      axes are read from the batch's type (an `axis_name` given there must
      name some of them); with `Auto` axes pass
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
    - `accumulator_dtype`: the least dtype floating outputs are accumulated
      in, as in `MultiSteps`: each output accumulates in the least dtype
      holding both its own and this one (an output wider than it keeps its
      own dtype), a `TypeError` where neither holds the other (float8
      kinds); `None` accumulates each output in its own dtype.
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
    - `per_example`: `False` (the default), `True`, `"gradient"`, or a
      pytree prefix of `grad_fn`'s output with such leaves: the outputs
      marked `True` or `"gradient"` have a row per example of the
      micro-batch (leading axis) and come back with a row per example of
      the whole batch, in the batch's order, not combined; those marked
      `"gradient"` scaled by their micro-batch's share of the batch (see
      above). With a sharded batch they stay sharded like it.
    - `num_real_microbatches`: None, or an int `n` (a traced one too, with
      no recompilation): only the first `n` micro-batches run (rows whose
      index mod `k` is below `n`, given the split above); the rest of the
      batch is never read. A batch padded at its end is reordered first
      (docs/multi_steps.md, "How `microbatched` splits the batch"). Means are over
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
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(
            "weight_fn must be None or a function taking grad_fn's arguments "
            "(the batch cut to one micro-batch) and returning its weight, got "
            f"{describe_value(weight_fn)}."
        )
    per_example = _check_per_example(per_example)
    settings = LoopSettings(
        grad_fn=grad_fn,
        num_microbatches=k,
        batch_argnums=argnums,
        key_argnum=key_argnum,
        accumulator_dtype=check_accumulator_dtype(accumulator_dtype, complex_ok=False),
        weight_fn=weight_fn,
        per_example=per_example,
        num_real_microbatches=_check_num_real(num_real_microbatches, k),
    )

    def wrapped(*args: Any, **kwargs: Any) -> PyTree:
        _check_call(settings, args)
        run, args, kwargs = _split_modules(settings, args, kwargs)
        return run_on_devices(run, axis_name, args, kwargs)

    # Name and docstring only: `functools.wraps` would also set `__wrapped__`,
    # which `eqx.filter_jit` takes for a JAX transform stored on a module.
    for attr in ("__name__", "__qualname__", "__doc__"):
        if hasattr(grad_fn, attr):
            setattr(wrapped, attr, getattr(grad_fn, attr))
    return wrapped


def _check_call(settings: LoopSettings, args: tuple) -> None:
    """Raises where a call's arguments do not fit `settings`: too few
    positional ones, a batch that does not split, or no PRNG key."""
    argnums, key_argnum = settings.batch_argnums, settings.key_argnum
    needed = max(argnums + ((key_argnum,) if key_argnum is not None else ()))
    if len(args) <= needed:
        name = getattr(settings.grad_fn, "__name__", "grad_fn")
        raise TypeError(
            f"microbatched({name}) takes the batch at positions {argnums}"
            + ("" if key_argnum is None else f" and the key at {key_argnum}")
            + f", but was called with {len(args)} positional arguments; "
            "pass them positionally."
        )
    _batch_size(args, argnums, settings.num_microbatches)
    if key_argnum is not None and not _is_single_prng_key(args[key_argnum]):
        key = args[key_argnum]
        raise TypeError(
            f"argument {key_argnum} (key_argnum) must be one PRNG key: a typed "
            "key of shape () (jax.random.key(...)), or a raw key of the "
            f"default implementation {_raw_key_impl()!r} (jax.random.PRNGKey"
            f"(...), uint32 of shape {_raw_key_shape()}); got "
            f"{type(key).__name__} of shape {jnp.shape(key)} and dtype "
            f"{getattr(key, 'dtype', None)}."
        )


def _split_modules(
    settings: LoopSettings, args: tuple, kwargs: dict
) -> tuple[LoopSettings, tuple, dict]:
    """Flax NNX modules among the arguments (not the batch or key) split
    into pytrees for the loop, and `grad_fn` and `weight_fn` made to merge
    them back (`_nnx_graph`); the call as it is where there are none."""
    keep = set(settings.batch_argnums) | {settings.key_argnum}
    args, kwargs, found = split_graph_nodes(args, kwargs, keep)
    if not found:
        return settings, args, kwargs
    weight_fn = settings.weight_fn
    return (
        settings._replace(
            grad_fn=merging(settings.grad_fn),
            weight_fn=None if weight_fn is None else merging(weight_fn),
        ),
        args,
        kwargs,
    )
