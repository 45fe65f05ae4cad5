"""`MultiSteps`: gradient accumulation, a drop-in for `optax.MultiSteps`.
A step prepares its inputs, decides whether the window ends, then folds and
runs the inner optimizer (`_accumulate/window`)."""

import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, PyTree

from . import _multi_steps_checks as checks
from ._accumulate.accumulations import OPTAX_FIELDS, NoiseScale, Plain, State, Weighted
from ._accumulate.arithmetic import check_accumulator_dtype, zero_accumulator
from ._accumulate.branch import choose_form
from ._accumulate.devices import PerDeviceState, SingleDeviceState
from ._accumulate.window import MiniStep, StepInputs, Window, run_window
from ._accumulate.xla import Mechanisms
from ._leaves import accumulated, restore_none
from ._records import strong_as_recorded, traced_state_record
from ._sharding import mirror_param_sharding
from ._static import Configured, config_key
from ._transformations import check_transformation, merge_trainable, with_extra_args
from ._tree import check_bool, saturating_increment


def _window_complete(mini_step: jax.Array, k: jax.Array) -> jax.Array:
    """Whether `mini_step` (from 0) ends a window of `k`; never `k <= 0` or NaN."""
    return jnp.logical_and(k > 0, mini_step + 1 >= k)


def _as_optax_holds_it(state: Any) -> Any:
    """`state`, nested `MultiSteps` states too, `acc_grads` zero at `mini_step` 0."""
    new = jnp.asarray(state.mini_step) == 0
    acc = jax.tree.map(lambda a: jnp.where(new, jnp.zeros_like(a), a), state.acc_grads)
    nested = lambda s: getattr(s, "_fields", ())[:5] == OPTAX_FIELDS
    fix = lambda s: _as_optax_holds_it(s) if nested(s) else s
    inner = jax.tree.map(fix, state.inner_opt_state, is_leaf=nested)
    return state._replace(acc_grads=acc, inner_opt_state=inner)


class MultiSteps(Configured):
    """Accumulates gradients over several mini-steps, then applies `opt` once.

    A drop-in for `optax.MultiSteps`: the same constructor, methods (extra keyword
    arguments such as `value=` go to the inner optimizer) and state, so a checkpoint
    moves between the two (to optax through `optax_state`). The mini-step completing
    a window of `k = every_k_schedule(gradient_step)` accepted mini-steps returns the
    inner optimizer's updates on the window's mean (or sum), every other exact zeros.
    Beyond optax: the inner state keeps every leaf's dtype, shape and weak type; no
    NaN or `inf` crosses a window; no gradient is rounded into a narrower accumulator
    (a `TypeError` instead); `params` may be an Equinox model. Equal arguments build
    equal `MultiSteps` (a static `jax.jit` argument compiles once). The full
    contract: `docs/multi_steps.md`.

    **Arguments:**

    - `opt`: the inner optimizer, an `optax.GradientTransformation`.
    - `every_k_schedule`: an int from 1 to `2**31 - 1` (a bool as its int), or a
      function from the gradient step (int32) to that window's number of mini-steps.
      A traced non-integer `k` closes it at `ceil(k)`, a traced `k <= 0` never (as
      in optax).
    - `use_grad_mean`: average the window's gradients if `True`, else sum them.
    - `should_skip_update_fn`: as in optax, `(updates, gradient_step, params)
      -> (should_skip, skip_state)`, `should_skip` a scalar bool; a skipped
      mini-step changes nothing else (e.g. `optax.skip_not_finite`).
    - `accumulator_dtype`: the least dtype to accumulate in: each leaf's
      holds it and the params leaf's (float32 for float32, bfloat16 and
      float16 params, as optax); `None`: the params leaf's own.
    - `axis_name`: accumulate per device inside `jax.shard_map` and average
      across this axis once per window (`docs/data_parallel.md`).
    - `weighted`: if `True`, each mini-step takes a `weight=` (a scalar >= 0,
      e.g. its non-padding tokens) and the window emits
      `sum_i w_i g_i / sum_i w_i` (`sum_i w_i g_i` with `use_grad_mean=False`).
      A weight of 0 leaves no trace; a window of weight 0 applies nothing and
      is not counted in `gradient_step`. The state: `WeightedMultiStepsState`.
    - `stochastic_rounding`: with `accumulator_dtype=jnp.bfloat16`, a
      bfloat16 accumulator for any float gradients of 32 bits or fewer,
      each fold rounded up or down without bias.
    - `noise_scale`: if `True`, each window also estimates the gradient noise
      scale from its micro-batch gradients (five scalars in the state's field
      `noise_scale`, read by `optax_ext.gradient_noise_scale(state)`).

    **Example:**

    ```python
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)  # zeros 3 times in 4
    ```
    """

    # `apply_gradients(..., emit=)` chooses where its windows end.
    takes_emit = True

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], Any],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., tuple[jax.Array, PyTree]] | None = None,
        accumulator_dtype: Any = jnp.float32,
        axis_name: Hashable | None = None,
        weighted: bool = False,
        *,
        stochastic_rounding: bool = False,
        noise_scale: bool = False,
    ):
        check_transformation(opt, "opt")
        mean = "use_grad_mean must be True (the gradients averaged) or False (summed)"
        use_grad_mean = check_bool(use_grad_mean, mean)
        weighted = check_bool(weighted, "weighted must be True or False")
        dtype = check_accumulator_dtype(accumulator_dtype, complex_ok=True)
        rounding = "stochastic_rounding must be True or False"
        stochastic = check_bool(stochastic_rounding, rounding)
        checks.check_stochastic_rounding(stochastic, dtype)
        noise = check_bool(noise_scale, "noise_scale must be True or False")
        on = Mechanisms()  # last in the key: `xla.configured` changes it
        single = axis_name is None
        given = (opt, every_k_schedule, use_grad_mean, should_skip_update_fn, dtype)
        self._key = config_key(*given, axis_name, weighted, stochastic, noise, on)
        parts = (NoiseScale(),) if noise else ()
        kind = (Weighted if weighted else Plain)(use_grad_mean, parts, stochastic)
        self._window = Window(
            inner=with_extra_args(opt),
            fusable_inner=opt,
            devices=SingleDeviceState() if single else PerDeviceState(axis_name),
            accumulation=kind,
            accumulator_dtype=dtype,
            inner_structures={},
            every_k_schedule=checks.check_every_k(every_k_schedule),
            should_skip_update_fn=checks.check_skip_fn(should_skip_update_fn),
            mechanisms=on,
        )

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._window.inner

    def init(self, params: optax.Params) -> State:
        """Builds the initial state for `params`. With `axis_name`, call it
        inside `jax.shard_map`: `acc_grads` and `skip_state` then hold this
        device's own values (`state_specs`)."""
        params = accumulated(params)
        w, zero = self._window, lambda: jnp.zeros((), jnp.int32)
        w.devices.check_bound("init")
        acc = zero_accumulator(params, w.accumulator_dtype, w.accumulation.stochastic)
        inner_state = w.inner.init(params)
        traced_state_record(w.inner.init, params, w.inner_structures, is_params=True)
        zeros = jax.tree.map(jnp.zeros_like, params)
        skip = checks.skip_decision(w.should_skip_update_fn, zeros, zero(), params)[1]
        fields = (zero(), zero(), inner_state, acc, skip)
        state = mirror_param_sharding(optax.MultiStepsState(*fields), params)
        fields = (*state[:3], *map(w.devices.add_axis, state[3:]))  # acc, skip
        carry = w.devices.add_axis(w.accumulation.init(acc))
        return w.accumulation.state(fields, carry)

    def state_specs(self) -> State:
        """`PartitionSpec`s of the state (a prefix of its tree) for
        `jax.shard_map`: `P()`, but `P(axis_name)` for `acc_grads` and
        `skip_state` (and a weighted state's `acc_weight`) with `axis_name`."""
        w, same = self._window, jax.sharding.PartitionSpec()
        own = w.devices.spec()
        carry = jax.eval_shape(w.accumulation.init, ())
        carry = jax.tree.map(lambda _: own, carry)
        return w.accumulation.state((same, same, same, own, own), carry)

    def update(
        self,
        updates: optax.Updates,
        state: State,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, State]:
        """Accumulates `updates`; returns the inner optimizer's updates on the
        last mini-step of a window and zeros otherwise. With `weighted=True`,
        pass `weight=` (not forwarded to the inner optimizer)."""
        return self._step(updates, state, params, extra_args, fused=False)

    def _apply_gradients(
        self,
        grads: optax.Updates,
        state: State,
        params: optax.Params,
        *,
        emit: bool | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Params, State]:
        """`update` and `optax.apply_updates` fused (`optax_ext.apply_gradients`)."""
        return self._step(grads, state, params, extra_args, fused=True, emit=emit)

    def _step(
        self,
        grads: PyTree,
        state: State,
        params: PyTree | None,
        extra: dict[str, Any],
        *,
        fused: bool,
        emit: bool | None = None,
    ) -> tuple[PyTree, State]:
        """`update` (`fused=False`) or `_apply_gradients`."""
        method = "apply_gradients" if fused else "update"
        inputs = checks.prepare_step(self._window, grads, state, params, extra, method)
        step = self._decide(inputs, state, emit)
        form = choose_form(fused, emit, self._window.devices.per_device)
        args = (self._window, form, fused, step, inputs, state.acc_grads)
        out, inner_state, acc, carry, emitted = run_window(*args, state.inner_opt_state)
        out = merge_trainable(params, out) if fused else restore_none(grads, out)
        inner_state = strong_as_recorded(inner_state, inputs.record)
        skip_state = self._window.devices.add_axis(inputs.skip_state)
        n, gradient = step.index, step.gradient_step
        count = jnp.where(inputs.should_skip, n, saturating_increment(n))
        mini = jnp.where(step.window_end, 0, count).astype(n.dtype)
        gradient = jnp.where(emitted, saturating_increment(gradient), gradient)
        fields = (mini, gradient, inner_state, acc, skip_state)
        return out, self._window.accumulation.state(fields, carry)

    def _decide(self, inputs: StepInputs, state: State, emit: bool | None) -> MiniStep:
        """This mini-step's weights and whether it ends its window (`k`, `emit`)."""
        mini_step = jnp.asarray(state.mini_step)
        carry = self._window.accumulation.carry(state)
        weights = self._window.accumulation.begin(carry, inputs.weight, mini_step)
        ends = _window_complete(mini_step, inputs.k) if emit is None else emit
        window_end = jnp.logical_and(jnp.logical_not(inputs.should_skip), ends)
        gradient_step = jnp.asarray(state.gradient_step)
        return MiniStep(window_end, mini_step, gradient_step, weights, carry)

    def optax_state(self, state: State) -> State:
        """`state` as `optax.MultiSteps` holds it at the same step, for it to go on
        from: `acc_grads` zeros after a window's last mini-step (nested `MultiSteps`
        states too). Jittable. Refused: a window held open past its length
        (`emit=False`) where the counters are known, and a weighted state (optax
        would drop its `acc_weight`). Example: `docs/multi_steps.md`, "State"."""
        checks.check_state(state, "optax_state")
        state = self._window.accumulation.as_optax(state)
        mini, k = self._host_window(state) or (0, 0)  # traced: not refused
        k = float(k)
        if k >= 1 and mini >= math.ceil(k):
            raise ValueError(
                f"MultiSteps.optax_state: the state's window holds {mini} mini-steps, "
                f"not closed at its length {k:g} (held open by `emit=False`); optax "
                "emits only at mini-step k - 1, so would never close it. Close it "
                "first: one more step with `emit=True` or without `emit`."
            )
        return _as_optax_holds_it(state)

    def emits_next(self, state: State) -> bool:
        """Whether the window ends on the next accepted mini-step, for a host loop
        passing `apply_gradients(..., emit=)`; not inside `jit` (it reads the
        counters off the device). After a resume, count from `int(state.mini_step)`.
        Example: `docs/multi_steps.md`, "The fused train step"."""
        checks.check_state(state, "emits_next")
        known = self._host_window(state)
        if known is None:
            raise TypeError(
                "MultiSteps.emits_next got traced counters: call it outside jax.jit."
            )
        return bool(_window_complete(jnp.asarray(known[0]), known[1]))

    def _host_window(self, state: State) -> tuple[int, jax.Array] | None:
        """`mini_step` and its window's `k` on the host (`None`: traced), `k` checked
        as the jitted step checks it: a JAX array, traced there, is not."""
        counters = (state.mini_step, state.gradient_step)
        if any(isinstance(c, jax.core.Tracer) for c in counters):
            return None
        mini, gradient = (int(c) for c in jax.device_get(counters))
        step = jnp.asarray(gradient, jnp.int32)
        k = self._window.every_k_schedule(step)
        return mini, k if isinstance(k, jax.Array) else checks.check_k(k, step)

    def has_updated(self, state: State) -> Bool[Array, ""]:
        """`True` when the last *accepted* mini-step completed a window
        (`mini_step == 0 and gradient_step > 0`, as in optax: still `True`
        after a skipped step that follows; `state.skip_state` tells)."""
        checks.check_state(state, "has_updated", counters=False)
        new = jnp.asarray(state.mini_step) == 0
        return jnp.logical_and(new, jnp.asarray(state.gradient_step) > 0)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This optimizer as a plain `optax.GradientTransformationExtraArgs`."""
        return self.as_transformation()
