"""Time of one accumulation window (K mini-steps, the last one emitting) on 8
simulated CPU devices: deferred reduction (`optax_ext.MultiSteps(...,
axis_name="data")`, one all-reduce per window) against the conventional
form (`pmean` of every mini-step's gradients, then `optax.MultiSteps`).

    python benchmarks/data_parallel.py      # or: nox -s bench

Candidates run interleaved round-robin in one process; medians are
reported, with the bytes each device sends per window under a ring
all-reduce, 2 (n - 1) / n times the reduced bytes. Simulated devices share
the host's cores and memory, so the communication saved here is a memory
copy, far cheaper than a network hop: the ratio is a lower bound on the
saving across hosts. Writes benchmarks/results/data_parallel.md.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_ext  # noqa: E402

K = 4
ROUNDS = 15
SIZES = {"1M": 1 << 20, "4M": 1 << 22}
RESULTS = pathlib.Path(__file__).parent / "results"


def to_varying(tree):
    if hasattr(lax, "pcast"):
        return lax.pcast(tree, "data", to="varying")
    return lax.pvary(tree, "data")


def loss_fn(params, x):
    # Cheap per-device compute, so that the reduction is what is measured.
    return sum(jnp.mean(w * x) for w in jax.tree.leaves(params))


def candidates(mesh, n_params):
    params = {f"w{i}": jnp.zeros((n_params // 8 // 256, 256)) for i in range(8)}
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    x = jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P("data")))
    deferred = optax_ext.MultiSteps(optax.adam(1e-3), K, axis_name="data")
    conventional = optax.MultiSteps(optax.adam(1e-3), K)
    specs = deferred.state_specs()

    @partial(jax.jit, donate_argnums=(0, 1))
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def d_step(params, state, x):
        grads = jax.grad(loss_fn)(to_varying(params), x)
        updates, state = deferred.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @partial(jax.jit, donate_argnums=(0, 1))
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    def c_step(params, state, x):
        grads = lax.pmean(jax.grad(loss_fn)(to_varying(params), x), "data")
        updates, state = conventional.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    d_state = jax.jit(
        jax.shard_map(deferred.init, mesh=mesh, in_specs=P(), out_specs=specs)
    )(params)
    c_state = jax.jit(conventional.init)(params)
    return {
        "deferred": (d_step, jax.tree.map(jnp.copy, params), d_state),
        "per-step pmean": (c_step, jax.tree.map(jnp.copy, params), c_state),
    }, x


def window(step, params, state, x):
    for _ in range(K):
        params, state = step(params, state, x)
    jax.block_until_ready((params, state))
    return params, state


def main() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    n = jax.device_count()
    rows = []
    with jax.set_mesh(mesh):
        for label, size in SIZES.items():
            cands, x = candidates(mesh, size)
            live = {name: [s, p, st] for name, (s, p, st) in cands.items()}
            for name in live:  # compile and warm up
                live[name][1:] = window(*live[name], x)
            times = {name: [] for name in live}
            for _ in range(ROUNDS):
                for name in live:
                    start = time.perf_counter()
                    live[name][1:] = window(*live[name], x)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            reduced = size * 4  # float32 gradients
            ring = 2 * (n - 1) / n * reduced / 2**20
            rows.append(
                f"| {label} | {med['per-step pmean']:.1f} | {med['deferred']:.1f} | "
                f"**{med['deferred'] / med['per-step pmean']:.2f}** | "
                f"{K * ring:.1f} | {ring:.1f} |"
            )
            print(rows[-1], flush=True)
    header = (
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {n} simulated CPU "
        f"devices, jax {jax.__version__}, optax {optax.__version__}. K = {K} "
        f"mini-steps per window, adam, float32 params in 8 matrices; medians of "
        f"{ROUNDS} interleaved rounds.\n\n"
        "| params | per-step pmean ms / window | deferred ms / window | deferred / "
        "per-step | MiB sent per device per window, per-step | deferred |\n"
        "|---|---|---|---|---|---|\n"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_parallel.md").write_text(header + "\n".join(rows) + "\n")
    print(header + "\n".join(rows))


if __name__ == "__main__":
    main()
