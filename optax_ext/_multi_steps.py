"""`MultiSteps`: gradient accumulation, a drop-in for `optax.MultiSteps`.

Each step folds the gradients into a running mean (or sum) in place; on the
last mini-step of a window the inner optimizer runs, inside one `lax.cond`,
on the window's mean. Everything is chosen by selection, never by
arithmetic on state, so no dtype changes and no NaN or `inf` crosses a
window. With `axis_name`, each device accumulates its own gradients and they
are averaged once per window. How the accumulator, the inner state and the
params stay in their donated buffers is in `docs/design.md`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ._apply import apply_gradients, merge_trainable
from ._conditional import check_transformation, update_if
from ._sharding import mirror_param_sharding, varying_axes
from ._static import Method, config_key
from ._tree import (
    check_same_shapes,
    check_same_structure,
    saturating_increment,
    trainable,
)

PyTree = Any


def _validate_every_k(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
    if callable(every_k_schedule):
        return every_k_schedule
    if not isinstance(every_k_schedule, bool):
        try:
            k = operator.index(every_k_schedule)
        except TypeError:
            pass
        else:
            if k <= 0:
                raise ValueError(
                    f"every_k_schedule must be a positive int, got {k}: it is the "
                    "number of mini-steps accumulated per update."
                )
            return lambda _: k
    raise TypeError(
        "every_k_schedule must be a positive int or a function of the gradient "
        f"step returning one, got {every_k_schedule!r} of type "
        f"{type(every_k_schedule).__name__}."
    )


def _check_k(k: Any) -> jax.Array:
    """The window length from `every_k_schedule`: a scalar int (a float is
    accepted, as optax does); a concrete value must be positive."""
    k = jnp.asarray(k)
    if k.shape != () or not (
        jnp.issubdtype(k.dtype, jnp.integer) or jnp.issubdtype(k.dtype, jnp.floating)
    ):
        raise TypeError(
            "every_k_schedule must return a scalar int (the number of mini-steps "
            f"in this window), got dtype {k.dtype} and shape {k.shape}."
        )
    try:
        concrete = float(k)
    except jax.errors.ConcretizationTypeError:
        return k  # traced under jit: checked by the caller's values
    if concrete < 1:
        raise ValueError(
            f"every_k_schedule returned {concrete:g}; a window needs at least one "
            "mini-step."
        )
    return k


def _check_skip_output(out: Any, fn: Callable) -> tuple[jax.Array, PyTree]:
    name = getattr(fn, "__name__", repr(fn))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"should_skip_update_fn {name} must return a pair (should_skip, "
            f"skip_state), got {type(out).__name__}: {out!r}."
        )
    should_skip, skip_state = out
    dtype = getattr(should_skip, "dtype", None)
    if isinstance(should_skip, bool):
        should_skip = jnp.asarray(should_skip)
    elif dtype != jnp.bool_ or jnp.shape(should_skip) != ():
        raise TypeError(
            f"should_skip_update_fn {name} must return a scalar bool as its first "
            f"output, got {type(should_skip).__name__} {should_skip!r} (dtype "
            f"{dtype}, shape {jnp.shape(should_skip)}). "
            "Reduce it to one decision, e.g. with `jnp.any(...)`."
        )
    return should_skip, skip_state


def _add_device_axis(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def _drop_device_axis(acc_grads: PyTree, axis_name: Any) -> PyTree:
    def drop(path, x):
        if jnp.ndim(x) == 0 or jnp.shape(x)[0] != 1:
            raise ValueError(
                f"MultiSteps(axis_name={axis_name!r}) expects this device's "
                "accumulator, with a leading axis of length 1, at "
                f"acc_grads{jax.tree_util.keystr(path)}; got shape {jnp.shape(x)}. "
                "Build the state with `opt.init` inside `jax.shard_map` and pass "
                "`opt.state_specs()` as the state's in_specs and out_specs."
            )
        return x[0]

    return jax.tree_util.tree_map_with_path(drop, acc_grads)


def _check_local_gradients(updates: PyTree, acc: PyTree, axis_name: Any) -> None:
    """Under `shard_map`'s type checks, raises if the gradients are the same
    on every device while the accumulator is not: `jax.grad` with respect to
    replicated params has then already summed them over the devices, and
    averaging them again would be silently wrong."""
    for (path, g), a in zip(
        jax.tree_util.tree_flatten_with_path(updates)[0],
        jax.tree.leaves(acc),
        strict=True,
    ):
        g_axes, a_axes = varying_axes(g), varying_axes(a)
        if g_axes is None or a_axes is None:
            return
        if axis_name in a_axes and axis_name not in g_axes:
            raise ValueError(
                f"MultiSteps(axis_name={axis_name!r}) accumulates each device's "
                "own gradients and averages them once per window, but the "
                f"gradients at {jax.tree_util.keystr(path) or 'the root'} are "
                f"the same on every device along {axis_name!r}: under "
                "`jax.shard_map`, `jax.grad` with respect to replicated params "
                "sums the gradients over the devices already. Take the gradient "
                f"with respect to `jax.lax.pcast(params, {axis_name!r}, "
                "to='varying')` to get this device's gradients."
            )


class MultiSteps:
    """Accumulates gradients over several mini-steps, then applies `opt` once.

    A drop-in for `optax.MultiSteps`: the same constructor, `init`, `update`
    (extra keyword arguments such as `value=` go to the inner optimizer),
    `has_updated`, `inner_opt` and `gradient_transformation()`, and the same
    state type, `optax.MultiStepsState`, so a checkpoint written by one loads
    into the other.

    Each `update` folds the gradients into `acc_grads`. On the mini-step that
    completes a window of `k = every_k_schedule(gradient_step)` accepted
    mini-steps, the inner optimizer is applied to the window's mean (or sum)
    and its updates are returned; on every other mini-step the updates are
    exact zeros and the inner optimizer does not run.

    Guarantees beyond optax:

    - every leaf of the inner state keeps its dtype, shape and weak type on
      every step (bool, all integer widths, float16, bfloat16, float32,
      float64, complex, typed PRNG keys): the state is selected, never
      blended. If the inner optimizer itself returns a leaf of another dtype
      or weak type, it is converted back to the one it had before the step;
      a leaf that changes shape is an error;
    - non-emitting steps return zeros in the inner updates' dtype, never NaN,
      whatever the inner optimizer would have computed;
    - the accumulator is reset by selection, so a NaN or `inf` in one window
      never reaches the next one;
    - `params` may be a whole Equinox model: leaves that are not floating
      arrays (functions, integer buffers, keys) are not optimised (they get
      `None` in the state, as `eqx.filter_grad` gives `None` for them and
      `eqx.apply_updates` skips them).

    **Numerics:** the mean is a running (Welford) mean,
    `acc + (g - acc) / (n + 1)`, kept in `promote_types(g.dtype,
    accumulator_dtype)`: float32 for bfloat16 and float16 gradients, the
    gradient's own dtype for float64 and complex ones. It is cast back to the
    gradient's dtype before the inner optimizer sees it.

    **Arguments:**

    - `opt`: the inner optimizer, an `optax.GradientTransformation`.
    - `every_k_schedule`: a positive int, or a function from the gradient step
      (int32 scalar) to the number of mini-steps in that window.
    - `use_grad_mean`: average the window's gradients if `True`, else sum them.
    - `should_skip_update_fn`: as in optax, a function `(updates,
      gradient_step, params) -> (should_skip, skip_state)`; a skipped
      mini-step leaves the accumulator, counters and inner state as they were
      (e.g. `optax.skip_not_finite`). It must return a scalar bool.
    - `accumulator_dtype`: the least dtype to accumulate in (see Numerics);
      `None` accumulates in each gradient's own dtype.

    Two `MultiSteps` built from equal arguments (the same inner optimizer
    object, or inner optimizers of this package built from equal arguments)
    compare and hash equal, so a jitted step that takes the optimizer as a
    static argument compiles once for both.

    **Example:**

    ```python
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)  # zeros 3 times in 4
    ```
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], Any],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., tuple[jax.Array, PyTree]] | None = None,
        accumulator_dtype: Any = jnp.float32,
        axis_name: Hashable | None = None,
    ):
        check_transformation(opt, "opt")
        if should_skip_update_fn is not None and not callable(should_skip_update_fn):
            raise TypeError(
                "should_skip_update_fn must be None or a function "
                f"(updates, gradient_step, params) -> (bool, state), got "
                f"{should_skip_update_fn!r}."
            )
        self._opt = optax.with_extra_args_support(opt)
        # As given: `apply_gradients` fuses through a nested MultiSteps or
        # skip_when, which `with_extra_args_support` would hide.
        self._fusable_inner = opt
        self._every_k_schedule = _validate_every_k(every_k_schedule)
        self._use_grad_mean = bool(use_grad_mean)
        self._should_skip_update_fn = should_skip_update_fn
        self._accumulator_dtype = (
            None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)
        )
        self._key = config_key(
            opt,
            every_k_schedule,
            self._use_grad_mean,
            should_skip_update_fn,
            self._accumulator_dtype,
            axis_name,
        )
        self._axis_name = axis_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MultiSteps) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._opt

    def _acc_dtype(self, dtype: Any) -> Any:
        if self._accumulator_dtype is None:
            return dtype
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.promote_types(dtype, self._accumulator_dtype)
        return self._accumulator_dtype

    def _should_skip(
        self, updates: PyTree, gradient_step: jax.Array, params: PyTree
    ) -> tuple[jax.Array, PyTree]:
        fn = self._should_skip_update_fn
        if fn is None:
            return jnp.zeros((), jnp.bool_), ()
        return _check_skip_output(fn(updates, gradient_step, params), fn)

    def init(self, params: PyTree) -> optax.MultiStepsState:
        """Builds the initial `optax.MultiStepsState` for `params`.

        With `axis_name`, call it where that axis is bound (inside
        `jax.shard_map`): `acc_grads` and `skip_state` then hold this
        device's own values, with a leading axis of length 1 (see
        `state_specs`).
        """
        params = trainable(params)
        per_device = self._per_device_view("init")
        acc_grads = jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), self._acc_dtype(jnp.result_type(p))),
            params,
        )
        gradient_step = jnp.zeros((), jnp.int32)
        _, skip_state = self._should_skip(
            jax.tree.map(jnp.zeros_like, params), gradient_step, params
        )
        state = optax.MultiStepsState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=acc_grads,
            skip_state=skip_state,
        )
        state = mirror_param_sharding(state, params)
        if per_device:
            state = state._replace(
                acc_grads=_add_device_axis(state.acc_grads),
                skip_state=_add_device_axis(state.skip_state),
            )
        return state

    def state_specs(self) -> optax.MultiStepsState:
        """`jax.sharding.PartitionSpec`s of the state, for `jax.shard_map`'s
        `in_specs` and `out_specs` (a prefix of the state's tree).

        Without `axis_name` every part is `P()`. With it, `acc_grads` and
        `skip_state` are `P(axis_name)`: outside `shard_map` each of their
        leaves has a leading axis with one entry per device, since every
        device accumulates its own gradients; the counters and the inner
        state are the same on every device, `P()`.
        """
        replicated: Any = jax.sharding.PartitionSpec()
        per_device: Any = (
            replicated
            if self._axis_name is None
            else jax.sharding.PartitionSpec(self._axis_name)
        )
        return optax.MultiStepsState(
            mini_step=replicated,
            gradient_step=replicated,
            inner_opt_state=replicated,
            acc_grads=per_device,
            skip_state=per_device,
        )

    def _per_device_view(self, method: str) -> bool:
        """Whether the state holds per-device accumulators; checks that
        `axis_name` is bound where `method` runs."""
        if self._axis_name is None:
            return False
        try:
            lax.axis_size(self._axis_name)
        except NameError as e:
            raise NameError(
                f"MultiSteps(axis_name={self._axis_name!r}).{method} must run "
                f"where the mesh axis {self._axis_name!r} is bound, inside "
                "`jax.shard_map` (or `jax.vmap`/`jax.pmap` with that axis_name), "
                "with the state's `acc_grads` and `skip_state` split over it: "
                "pass `opt.state_specs()` as their in_specs and out_specs. "
                f"({e})"
            ) from None
        return True

    def update(
        self,
        updates: PyTree,
        state: optax.MultiStepsState,
        params: PyTree | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, optax.MultiStepsState]:
        """Accumulates `updates`; returns the inner optimizer's updates on the
        last mini-step of a window and zeros otherwise."""
        return self._step(updates, state, params, extra_args, fused=False)

    def apply_gradients(
        self,
        grads: PyTree,
        state: optax.MultiStepsState,
        params: PyTree,
        **extra_args: Any,
    ) -> tuple[PyTree, optax.MultiStepsState]:
        """`update` followed by applying the updates to `params`, fused: a
        mini-step returns `params` as they came in, without building zero
        updates. Prefer `optax_ext.apply_gradients`, which calls this."""
        return self._step(grads, state, params, extra_args, fused=True)

    def _step(
        self,
        updates: PyTree,
        state: optax.MultiStepsState,
        params: PyTree | None,
        extra_args: dict[str, Any],
        *,
        fused: bool,
    ) -> tuple[PyTree, optax.MultiStepsState]:
        per_device = self._per_device_view("update")
        acc_in = state.acc_grads
        if per_device:
            acc_in = _drop_device_axis(acc_in, self._axis_name)
        check_same_structure(
            acc_in,
            updates,
            expected_name="the accumulated gradients in the state",
            got_name="the updates",
        )
        check_same_shapes(
            acc_in,
            updates,
            expected_name="the accumulated gradients",
            got_name="the updates",
            hint="the gradients must have the shapes of the params.",
        )
        if per_device:
            _check_local_gradients(updates, acc_in, self._axis_name)
        all_params = params
        if params is not None:
            params = trainable(params)
        mini_step = jnp.asarray(state.mini_step)
        gradient_step = jnp.asarray(state.gradient_step)
        k = _check_k(self._every_k_schedule(gradient_step))
        should_skip, skip_state = self._should_skip(updates, gradient_step, params)
        if per_device and self._should_skip_update_fn is not None:
            # Every device must take the same decision, or their windows
            # drift apart: one scalar all-reduce per mini-step.
            votes = lax.psum(should_skip.astype(jnp.int32), self._axis_name)
            should_skip = votes > 0

        def accumulate(g: jax.Array, acc: jax.Array) -> jax.Array:
            g = g.astype(acc.dtype)
            if self._use_grad_mean:
                running = acc + (g - acc) / (mini_step + 1).astype(acc.dtype)
            else:
                running = acc + g
            # The first mini-step of a window *selects* its gradient, so even a
            # state whose buffer holds a NaN (one saved by optax.MultiSteps,
            # say) starts the window clean.
            new = jnp.where(mini_step == 0, g, running)
            if self._should_skip_update_fn is None:
                return new
            return jnp.where(should_skip, acc, new)

        # With `axis_name` the accumulator keeps its device axis through the
        # `cond` (the gradient gets one): a reshape of the `cond`'s result made
        # XLA copy it into the state.
        add_axis = jnp.expand_dims if per_device else (lambda g, _: g)
        acc_grads = jax.tree.map(
            lambda g, acc: accumulate(add_axis(g, 0), acc), updates, state.acc_grads
        )
        emit = jnp.logical_and(jnp.logical_not(should_skip), mini_step + 1 >= k)
        update_dtypes = jax.tree.map(lambda g: jnp.result_type(g), updates)

        def window_grads(acc_grads):
            if per_device:
                # The only collective of a window: this device's mean (or sum)
                # averaged over the devices, in the accumulator's dtype.
                acc_grads = jax.tree.map(lambda acc: acc[0], acc_grads)
                acc_grads = lax.pmean(acc_grads, self._axis_name)
            return jax.tree.map(lambda acc, dt: acc.astype(dt), acc_grads, update_dtypes)

        def inner_update(acc_grads, inner_state):
            grads = window_grads(acc_grads)
            return self._opt.update(grads, inner_state, params, **extra_args)

        def inner_apply(acc_grads, inner_state, params):
            grads = window_grads(acc_grads)
            return apply_gradients(
                self._fusable_inner, grads, inner_state, params, **extra_args
            )

        # Only the inner optimizer sits inside the `cond`. The accumulator goes
        # in and comes back out: cleared in the emitting branch once the inner
        # optimizer has read it, as it came in from the other. Both keep it in
        # the donated buffer (see docs/design.md). The state after an
        # emitting step holds zeros there, as optax's does: a state saved by
        # either implementation continues correctly in the other.
        if fused:
            new_params, inner_state, acc_grads = update_if(
                emit,
                inner_apply,
                acc_grads,
                state.inner_opt_state,
                clear_grads=True,
                carry=params,
            )
            result = merge_trainable(all_params, new_params)
        else:
            result, inner_state, acc_grads = update_if(
                emit, inner_update, acc_grads, state.inner_opt_state, clear_grads=True
            )
        if per_device:
            skip_state = _add_device_axis(skip_state)
        new_state = optax.MultiStepsState(
            mini_step=jnp.where(
                emit, 0, jnp.where(should_skip, mini_step, mini_step + 1)
            ).astype(mini_step.dtype),
            gradient_step=jnp.where(
                emit, saturating_increment(gradient_step), gradient_step
            ),
            inner_opt_state=inner_state,
            acc_grads=acc_grads,
            skip_state=skip_state,
        )
        return result, new_state

    def has_updated(self, state: optax.MultiStepsState | PyTree) -> jax.Array:
        """Whether the last `update` with this state emitted non-zero updates."""
        return jnp.logical_and(
            jnp.asarray(state.mini_step) == 0, jnp.asarray(state.gradient_step) > 0
        )

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This optimizer as a plain `optax.GradientTransformationExtraArgs`."""
        return optax.GradientTransformationExtraArgs(
            Method(self, "init"), Method(self, "update")
        )
