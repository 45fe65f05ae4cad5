"""`MultiSteps(..., weighted=True)`: its state and the window's running
weight (`docs/multi_steps.md`, "Uneven micro-batches")."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._accumulate.accumulator import Accumulator, Weights


class WeightedMultiStepsState(NamedTuple):
    """The state of `MultiSteps(..., weighted=True)`: the fields of
    `optax.MultiStepsState`, in its order, and the window's running weight."""

    mini_step: jax.Array
    """The number of mini-steps accumulated in this window (int32)."""
    gradient_step: jax.Array
    """The number of windows applied (int32); a window of weight 0 is not."""
    inner_opt_state: Any
    """The inner optimizer's state."""
    acc_grads: Any
    """The window's weighted running mean of the gradients."""
    skip_state: Any
    """What `should_skip_update_fn` returned last (`()` without one)."""
    acc_weight: jax.Array
    """The sum of the window's weights so far (float32; float64 for float64
    or complex128 accumulators). With `axis_name`, this device's own."""


def window_weights(
    accumulator: Accumulator, acc_weight: jax.Array, weight: Any, mini_step: jax.Array
) -> tuple[jax.Array, Weights]:
    """The state's running weight as it came in, and how `weight` folds in
    after it; a window's first mini-step starts from 0."""
    stored = acc_weight if jnp.ndim(acc_weight) == 0 else acc_weight[0]
    dtype = stored.dtype
    if not isinstance(weight, jax.Array):  # a Python or NumPy number: in
        # float directly (JAX would make an int64 an int32 first, wrapping it)
        weight = np.asarray(weight).astype(dtype)
    w = lax.convert_element_type(weight, dtype)
    before = jnp.where(mini_step == 0, jnp.zeros((), dtype), stored)
    return stored, accumulator.weigh(before, w)
