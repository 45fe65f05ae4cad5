"""`nnx_apply_gradients`: `apply_gradients` on an `nnx.Optimizer` and its
model in place. Flax is never imported here (docs/design.md, "Flax NNX")."""

import sys
from typing import Any

from ._apply import apply_gradients
from ._linen import check_emit

_NAME = "optax_ext.nnx_apply_gradients"


def nnx_apply_gradients(
    optimizer: Any,
    model: Any,
    grads: Any,
    /,
    *,
    emit: bool | None = None,
    **extra_args: Any,
) -> None:
    """`optimizer.update(model, grads)` for a Flax `nnx.Optimizer`, through
    `optax_ext.apply_gradients`: fused for `MultiSteps`, with `weight=` and
    `emit=`. It updates the model and optimizer in place as `update` does
    (`wrt`, `optimizer.step`), so one optimizer and its checkpoints take
    both; inside `nnx.jit` or outside.

    **Arguments:**

    - `optimizer`: an `nnx.Optimizer`; its `tx` any optax optimizer, an
      `optax_ext.MultiSteps` for the fused step.
    - `model`: the NNX module `optimizer` was built for.
    - `grads`: its gradients, as `nnx.grad(loss)(model, ...)` returns them.
    - `emit`: for an `optax_ext.MultiSteps` only, a Python bool chosen on
      the host (see `apply_gradients`); static under `nnx.jit`.
    - `**extra_args`: passed to `tx.update` (`weight=`, `skip=`).

    **Returns:**

    None: `model` and `optimizer` are updated in place.

    **Example:**

    ```python
    from flax import nnx

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    tx = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optax_ext.nnx_apply_gradients(optimizer, model, grads)

    train_step(model, optimizer, jnp.ones((8, 4)))
    ```
    """
    nnx: Any = sys.modules.get("flax.nnx")  # None: no NNX optimizer exists
    if nnx is None or not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"{_NAME}: optimizer must be a flax `nnx.Optimizer` (built with "
            "`nnx.Optimizer(model, tx, wrt=nnx.Param)`), got "
            f"{type(optimizer).__name__}: {optimizer!r:.200}."
        )
    if not nnx.graph.is_graph_node(model):
        raise TypeError(
            f"{_NAME}: model must be the NNX module the optimizer was built "
            f"for (an `nnx.Module`), got {type(model).__name__}: {model!r:.200}."
        )
    check_emit(_NAME, "optimizer.tx", optimizer.tx, emit)
    # As `nnx.Optimizer.update` (flax 0.12) reads and writes its state.
    graph = {"graph": optimizer.graph} if hasattr(optimizer, "graph") else {}
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, **graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, optimizer.wrt, **graph))
    opt_state = nnx.as_pure(optimizer.opt_state)
    extra_args = nnx.as_pure(extra_args)
    new_params, new_opt_state = apply_gradients(
        optimizer.tx, grad_arrays, opt_state, params, emit=emit, **extra_args
    )
    nnx.update(model, new_params)
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state, **graph))
    optimizer.step[...] += 1
