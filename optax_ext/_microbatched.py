"""`microbatched`: gradient accumulation inside one compiled step, and the
checks of its arguments and calls."""

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
from ._nnx_graph import ModuleCarry, split_graph_nodes
from ._tree import as_index, check_bool, describe_value

_POSITION = ("non-negative", "a position in grad_fn's arguments", TypeError)
_COUNT = ("positive", "how many micro-batches the batch is split into", ValueError)


def _int(value: Any, name: str, kind: tuple = _POSITION) -> int:
    """`value` as an int of `kind`: a position (>= 0) or a count (>= 1)."""
    sign, what, error = kind
    i = as_index(value)
    if i is not None and i >= (kind is _COUNT):
        return i
    raise error(
        f"{name} must be a {sign} int ({what}), got {value!r} of type "
        f"{type(value).__name__}."
    )


def _check_argnums(
    batch_argnums: Any, key_argnum: Any
) -> tuple[tuple[int, ...], int | None]:
    if isinstance(batch_argnums, Sequence) and not isinstance(batch_argnums, str):
        if not batch_argnums:
            raise ValueError("batch_argnums must name at least one argument, got ().")
        argnums = tuple(_int(a, "batch_argnums") for a in batch_argnums)
    else:
        argnums = (_int(batch_argnums, "batch_argnums"),)
    if len(set(argnums)) != len(argnums):
        raise ValueError(f"batch_argnums has repeated positions: {batch_argnums!r}.")
    key = None if key_argnum is None else _int(key_argnum, "key_argnum")
    if key is not None and key in argnums:
        raise ValueError(
            f"key_argnum={key} is also in batch_argnums={argnums}: the key is "
            "split per micro-batch, not sliced like the batch."
        )
    return argnums, key


def _raw_key_impl() -> str:
    """The default PRNG implementation, which a raw uint32 key is read with."""
    return getattr(jax.config, "jax_default_prng_impl")  # noqa: B009


def _is_single_prng_key(x: Any) -> bool:
    """Whether `x` is one PRNG key (typed, or raw of the default PRNG), not a batch."""
    if is_typed_key(x):
        return jnp.ndim(x) == 0
    if getattr(x, "dtype", None) != jnp.uint32:
        return False
    wrap = functools.partial(jax.random.wrap_key_data, impl=_raw_key_impl())
    try:
        key = jax.eval_shape(wrap, jax.ShapeDtypeStruct(jnp.shape(x), jnp.uint32))
    except TypeError:  # key data of another implementation's shape
        return False
    return key.shape == ()


def _check_batch(args: tuple, argnums: tuple[int, ...], k: int) -> None:
    """Raises unless every batch leaf has one leading size, which splits in `k`."""
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


def _check_combine(weight_fn: Any, per_example: Any, use_grad_mean: Any) -> None:
    """Checks how outputs combine: `weight_fn`, `per_example`, `use_grad_mean`."""
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(
            "weight_fn must be None or a function taking grad_fn's arguments "
            "(the batch cut to one micro-batch) and returning its weight, got "
            f"{describe_value(weight_fn)}."
        )
    for mark in jax.tree.leaves(per_example):
        if not (isinstance(mark, bool | np.bool_) or is_gradient_mark(mark)):
            raise TypeError(
                "per_example must be True, False, 'gradient', or a pytree prefix of "
                "grad_fn's output with such leaves (True: rows returned as they "
                "are; 'gradient': rows of a gradient with respect to the batch); "
                f"got {per_example!r}, whose leaf {mark!r} is none of them."
            )
    check_bool(
        use_grad_mean,
        "use_grad_mean must be True (the micro-batches' outputs averaged) "
        "or False (summed)",
    )


def _check_num_real(value: Any, k: int) -> Any:
    """`num_real_microbatches`: None, or an int scalar from 0 to `k` where known."""
    if value is None:
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is None and not isinstance(value, bool):
        dtype = jnp.result_type(value)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or jnp.shape(value):
        raise TypeError(
            "num_real_microbatches must be None or an int scalar (how many "
            "of the micro-batches hold real data), got "
            f"{describe_value(value)}."
        )
    if isinstance(value, jax.core.Tracer):  # traced: not checked
        return value
    known = int(np.asarray(value))
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
    use_grad_mean: bool = True,
    per_example: Any = False,
    num_real_microbatches: int | jax.Array | None = None,
) -> Callable:
    """Computes `grad_fn` on a batch one micro-batch at a time, in one
    compiled loop: the in-step form of gradient accumulation.

    `microbatched(grad_fn, k)(*args)` returns what `grad_fn(*args)` returns
    on the whole batch, with the activation memory of `1/k` of it. Micro-batch
    `j` is the rows `j, j + k, j + 2k, ...`. Floating outputs are averaged as
    `MultiSteps`' running mean (the whole batch's value for a loss that is a
    **mean over the rows**), integer ones summed, bool ones `any`-ed, others
    returned as `grad_fn` gives them. On a sharded batch each device
    accumulates its rows, reduced across devices once after the loop.
    Keyword arguments are passed on unchanged. What the forward pass changes
    in an NNX module argument (BatchNorm's statistics, an `nnx.Rngs` count)
    goes from one micro-batch to the next and is in the module after the call.
    Details: docs/microbatched.md, docs/data_parallel.md, docs/nnx.md.

    **Arguments:**

    - `grad_fn`: the function to accumulate, e.g. `jax.grad(loss)`.
    - `num_microbatches`: a positive int `k` dividing the batch size.
    - `batch_argnums`: the position(s) of the batch in `grad_fn`'s
      arguments, pytrees of arrays with one leading size.
    - `key_argnum`: the position of a PRNG key, or None; micro-batch `j`
      gets `jax.random.split(key, k)[j]`.
    - `accumulator_dtype`: the least dtype floating outputs accumulate in
      (`None`: their own); they come back in their own dtypes.
    - `axis_name`: the mesh axis (or axes) the batch is sharded over, where
      the batch's type does not say.
    - `weight_fn`: None, or a function called like `grad_fn` on a
      micro-batch, returning its weight (a real scalar >= 0); floating
      outputs are then `sum_j w_j x_j / sum_j w_j`.
    - `use_grad_mean`: `False` sums the floating outputs instead
      (`sum_j w_j x_j` with `weight_fn`; averaged over devices without).
    - `per_example`: `False`, `True`, `"gradient"`, or a pytree prefix of
      the output with such leaves: marked outputs have a row per example
      and come back whole, `"gradient"` ones scaled by their share.
    - `num_real_microbatches`: None, or an int `n` (traced too): only the
      first `n` micro-batches run, and means are over them.

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
            f"grad_fn must be a function (e.g. jax.grad(loss)), got "
            f"{grad_fn!r} of type {type(grad_fn).__name__}."
        )
    k = _int(num_microbatches, "num_microbatches", _COUNT)
    argnums, key = _check_argnums(batch_argnums, key_argnum)
    _check_combine(weight_fn, per_example, use_grad_mean)
    dtype = check_accumulator_dtype(accumulator_dtype, complex_ok=False)
    num_real, mean = _check_num_real(num_real_microbatches, k), bool(use_grad_mean)
    settings = LoopSettings(
        grad_fn, k, argnums, key, dtype, weight_fn, per_example, num_real, mean
    )

    def wrapped(*args: Any, **kwargs: Any) -> PyTree:
        _check_call(settings, args)
        keep = set(settings.batch_argnums) | {settings.key_argnum}
        args, kwargs, found = split_graph_nodes(args, kwargs, keep)  # NNX modules
        run = settings._replace(modules=ModuleCarry(found)) if found else settings
        out, carried = run_on_devices(run, axis_name, args, kwargs)
        if run.modules is not None:
            run.modules.write_back(args, kwargs, carried)
        return out

    # Not `functools.wraps`: `eqx.filter_jit` takes `__wrapped__` for a transform.
    for attr in ("__name__", "__qualname__", "__doc__"):
        if hasattr(grad_fn, attr):
            setattr(wrapped, attr, getattr(grad_fn, attr))
    return wrapped


def _check_call(settings: LoopSettings, args: tuple) -> None:
    """Raises where a call's arguments do not fit `settings`."""
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
    _check_batch(args, argnums, settings.num_microbatches)
    if key_argnum is not None and not _is_single_prng_key(args[key_argnum]):
        key, impl = args[key_argnum], _raw_key_impl()
        shape = jax.eval_shape(functools.partial(jax.random.PRNGKey, impl=impl), 0)
        raise TypeError(
            f"argument {key_argnum} (key_argnum) must be one PRNG key: a typed key "
            "of shape () (jax.random.key(...)), or a raw key of the default "
            f"implementation {impl!r} (jax.random.PRNGKey(...), uint32 of shape "
            f"{shape.shape}); got {type(key).__name__} of shape {jnp.shape(key)} "
            f"and dtype {getattr(key, 'dtype', None)}."
        )
