"""`train_state_apply_gradients`: `apply_gradients` on a Linen `TrainState`; the
`emit=` check `_nnx` shares. No flax import (docs/design.md, "Flax NNX")."""

import sys
from collections.abc import Mapping
from typing import Any

from ._apply import apply_gradients
from ._transformations import owner

_NAME = "optax_ext.train_state_apply_gradients"
_FIELDS = ("step", "params", "tx", "opt_state", "replace")


def check_emit(who: str, where: str, tx: Any, emit: Any) -> None:
    """Raises where `emit` is given for a `tx` that is no `MultiSteps`."""
    if emit is not None and not getattr(owner(tx), "takes_emit", False):
        raise TypeError(
            f"{who}: emit={emit!r} chooses where an optax_ext.MultiSteps window "
            f"ends, so {where} must be an optax_ext.MultiSteps (or its "
            f"gradient_transformation()), got {tx!r:.200}. Leave emit out for "
            "any other optimizer."
        )


def train_state_apply_gradients(
    state: Any,
    /,
    grads: Any,
    *,
    emit: bool | None = None,
    **extra_args: Any,
) -> Any:
    """`state.apply_gradients(grads=grads)` for a Linen `TrainState` through
    `optax_ext.apply_gradients` (fused for `MultiSteps`; `weight=` and `emit=`
    reach `tx.update`). The new state is the stock method's (`step + 1`).

    **Arguments:**

    - `state`: a `TrainState` (or a subclass); its `tx` any optax
      optimizer, an `optax_ext.MultiSteps` for the fused step.
    - `grads`: the gradients of `state.params`.
    - `emit`: for an `optax_ext.MultiSteps` only, a Python bool chosen on
      the host (see `apply_gradients`); static under `jax.jit`.
    - `**extra_args`: passed to `state.tx.update` (`weight=`, `skip=`).

    **Returns:**

    The new state, of `state`'s type.

    **Example:**

    ```python
    from flax.training.train_state import TrainState

    tx = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=2, weighted=True)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def train_step(state, batch, tokens):
        grads = jax.grad(loss)(state.params, batch)
        return optax_ext.train_state_apply_gradients(state, grads, weight=tokens)

    state = train_step(state, batch, 16.0)
    ```
    """
    if not all(hasattr(state, name) for name in _FIELDS):
        raise TypeError(
            f"{_NAME}: state must be a flax `TrainState` (or what has "
            f"{', '.join(_FIELDS)}), got {type(state).__name__}: {state!r:.200}."
        )
    if replaced := sorted(name for name in extra_args if hasattr(state, name)):
        raise TypeError(
            f"{_NAME}: {replaced[0]}= names a field of the TrainState, but the "
            "keyword arguments go to state.tx.update (weight=, skip=), not to "
            "state.replace as in TrainState.apply_gradients. Replace it on the "
            f"result: `{_NAME}(state, grads).replace({replaced[0]}=...)`."
        )
    check_emit(_NAME, "state.tx", state.tx, emit)
    fp8_ops = sys.modules.get("flax.linen.fp8_ops")  # fp8 params: as flax 0.12
    key = getattr(fp8_ops, "OVERWRITE_WITH_GRADIENT", None)
    fp8 = key is not None and isinstance(grads, Mapping) and key in grads
    own_grads = grads["params"] if fp8 else grads
    params = state.params["params"] if fp8 else state.params
    new_params, opt_state = apply_gradients(
        state.tx, own_grads, state.opt_state, params, emit=emit, **extra_args
    )
    if fp8:
        new_params = {"params": new_params, key: grads[key]}
    return state.replace(step=state.step + 1, params=new_params, opt_state=opt_state)
