"""Data-parallel training of an Equinox model on 8 simulated CPU devices, with
gradient accumulation that communicates once per window.

Each device computes the gradient of its own shard of the batch and
`optax_ext.MultiSteps(..., axis_name="data")` accumulates it locally; the
cross-device mean is taken once, when the window emits. The script prints
the all-reduce count of each step's compiled program next to the
conventional form (all-reduce the gradients, then `optax.MultiSteps`), and
checks that both train to the same parameters.

    python examples/data_parallel.py

On a real cluster, call `jax.distributed.initialize()` first and build the
mesh over `jax.devices()`; nothing else changes (see docs/data_parallel.md).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import re  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_ext  # noqa: E402

K = 4  # mini-steps per optimizer step
STEPS = 30 * K
LOCAL_BATCH = 16


def to_varying(tree):
    """Typed as different on every device, so `jax.grad` gives each device
    its own gradient instead of summing them over the devices."""
    if hasattr(lax, "pcast"):
        return lax.pcast(tree, "data", to="varying")
    return lax.pvary(tree, "data")


def main() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params, x, y):
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    inner = optax.chain(optax_ext.zero_nans(), optax.adamw(1e-2))
    deferred = optax_ext.MultiSteps(inner, K, axis_name="data")
    conventional = optax.MultiSteps(inner, K)
    specs = deferred.state_specs()
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    @jax.jit
    @jax.shard_map(
        mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)
    )
    def deferred_step(params, state, x, y):
        grads = jax.grad(loss_fn)(to_varying(params), x, y)  # this device's own
        updates, state = deferred.update(grads, state, params)
        return eqx.apply_updates(params, updates), state

    @jax.jit
    @jax.shard_map(
        mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())
    )
    def conventional_step(params, state, x, y):
        grads = lax.pmean(jax.grad(loss_fn)(to_varying(params), x, y), "data")
        updates, state = conventional.update(grads, state, params)
        return eqx.apply_updates(params, updates), state

    n = jax.device_count() * LOCAL_BATCH
    xs = jax.random.normal(jax.random.key(1), (STEPS, n, 8))
    ys = jnp.sin(xs.sum(-1, keepdims=True))
    x_test = jax.random.normal(jax.random.key(2), (256, 8))
    y_test = jnp.sin(x_test.sum(-1, keepdims=True))

    with jax.set_mesh(mesh):
        params = jax.device_put(params, replicated)
        init = jax.shard_map(deferred.init, mesh=mesh, in_specs=P(), out_specs=specs)
        d_state = jax.jit(init)(params)
        c_state = jax.jit(conventional.init)(params)
        d_params, c_params = params, params
        first = jax.device_put((xs[0], ys[0]), batch)
        for name, step, state in [
            ("optax_ext.MultiSteps(axis_name='data')", deferred_step, d_state),
            ("pmean + optax.MultiSteps", conventional_step, c_state),
        ]:
            hlo = step.lower(params, state, *first).compile().as_text()
            print(f"{name:42s} all-reduces per step: {_all_reduce_summary(hlo)}")

        losses = []
        for t in range(STEPS):
            x, y = jax.device_put((xs[t], ys[t]), batch)
            d_params, d_state = deferred_step(d_params, d_state, x, y)
            c_params, c_state = conventional_step(c_params, c_state, x, y)
            if (t + 1) % (5 * K) == 0:  # loss on a fixed held-out batch
                losses.append(float(loss_fn(d_params, x_test, y_test)))
                print(f"optimizer step {(t + 1) // K:2d}: loss {losses[-1]:.4f}")

    gap = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree.leaves(d_params), jax.tree.leaves(c_params), strict=True
        )
    )
    print(f"largest parameter difference, deferred vs conventional: {gap:.2e}")
    if gap > 1e-4 or not losses[-1] < losses[0]:
        raise SystemExit("deferred accumulation did not match or did not train")


def _all_reduce_summary(hlo: str) -> str:
    """'N outside the conditional, M in the emitting branch' for compiled HLO."""
    total = len(re.findall(r" all-reduce(?:-start)?\(", hlo))
    branch = ""
    for line in hlo.splitlines():
        if " conditional(" in line:
            branch = re.search(r"branch_computations=\{%[^,}]+, %([^,}]+)\}", line)[1]
    in_branch = 0
    if branch:
        body = hlo.split(f"%{branch} ", 1)[1].split("\n}\n", 1)[0]
        in_branch = len(re.findall(r" all-reduce(?:-start)?\(", body))
    return (
        f"{total - in_branch} on every mini-step, "
        f"{in_branch} only when the window emits"
    )


if __name__ == "__main__":
    main()
