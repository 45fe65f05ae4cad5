"""Compiled memory per device with params sharded under plain `jax.jit`
(FSDP / ZeRO-3 style), on 8 simulated CPU devices, `Auto` and `Explicit`
mesh axes.

    python benchmarks/sharded.py

Two tables, both from `compiled.memory_analysis()` and the compiled HLO (no
timing: 8 devices simulated on a few cores say nothing about speed):

- the donated train step (`update` + `apply_updates`, or the fused
  `optax_ext.apply_gradients`) of inner Adam with a mini-step's window:
  params of 8 leaves of (2048, 512) float32 split on their first axis over
  the mesh axis `fsdp`, gradients alike. Temporary memory per device in
  units of the params per device, and the copies of a params shard;
- the gradient of an MLP (`jax.grad` of a mean loss) with its params split
  the same way and the batch split over the same axis, full batch against
  `optax.microbatching.microbatch` and `optax_ext.microbatched` (k = 8),
  jitted with the gradients sharded as the params: temporary memory per
  device, and its ratio to the full batch's.

Writes benchmarks/results/sharded.md (`--name NAME`: NAME.md, for a run
with another JAX).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import code_version  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_ext  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODES = ("Auto", "Explicit")
LEAVES, SHAPE, WINDOW = 8, (2048, 512), 4
K = 8
MLPS = {  # name: (input width, hidden width, hidden layers, batch rows)
    "activations dominate: MLP 256-1024x4-8, batch 8192": (256, 1024, 4, 8192),
    "params dominate: MLP 2048-2048x8-8, batch 512": (2048, 2048, 8, 512),
}


def _mesh(mode):
    return jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(AxisType, mode),))


def _shard_copies(hlo, shard_shape):
    """Copies of an array of a params shard's shape."""
    dims = ",".join(map(str, shard_shape))
    return len(re.findall(rf"= f32\[{dims}\]\S* copy\(", hlo))


def train_step_row(mode, inner="adam"):
    mesh = _mesh(mode)
    split = NamedSharding(mesh, P("fsdp", None))
    params = {
        f"w{i}": jax.device_put(jnp.full(SHAPE, 0.01 * i, jnp.float32), split)
        for i in range(LEAVES)
    }
    per_device = sum(p.addressable_shards[0].data.nbytes for p in params.values())
    shard_shape = (SHAPE[0] // 8, SHAPE[1])
    tx = optax.adam(1e-3) if inner == "adam" else optax.lion(1e-4)
    forms = {
        "bare": (tx, False),
        "optax.MultiSteps": (optax.MultiSteps(tx, WINDOW), False),
        "optax_ext drop-in": (optax_ext.MultiSteps(tx, WINDOW), False),
        "optax_ext apply_gradients": (optax_ext.MultiSteps(tx, WINDOW), True),
    }
    cells = {}
    for name, (opt, fused) in forms.items():

        def step(params, state, grads, opt=opt, fused=fused):
            if fused:
                return optax_ext.apply_gradients(opt, grads, state, params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        with jax.set_mesh(mesh):
            state = jax.jit(opt.init)(params)
            compiled = (
                jax.jit(step, donate_argnums=(0, 1))
                .lower(params, state, params)
                .compile()
            )
        temp = compiled.memory_analysis().temp_size_in_bytes / per_device
        copies = _shard_copies(compiled.as_text(), shard_shape)
        cells[name] = f"{temp:.2f} ({copies} copies)"
    return cells


def _mlp_loss(params, batch):
    x, y = batch
    h = x
    for w in params[:-1]:
        h = jax.nn.gelu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def microbatched_row(mode, sizes):
    width_in, width, depth, rows = sizes
    mesh = _mesh(mode)
    widths = [width_in] + [width] * depth + [8]
    keys = jax.random.split(jax.random.key(0), depth + 3)
    split = NamedSharding(mesh, P("fsdp", None))
    params = [
        jax.device_put(jax.random.normal(key, (a, b)) / np.sqrt(a), split)
        for key, a, b in zip(keys, widths[:-1], widths[1:], strict=False)
    ]
    split_rows = NamedSharding(mesh, P("fsdp"))
    batch = (
        jax.device_put(jax.random.normal(keys[-2], (rows, width_in)), split_rows),
        jax.device_put(jax.random.normal(keys[-1], (rows, 8)), split_rows),
    )
    grad = jax.grad(_mlp_loss)
    candidates = {
        "full batch": grad,
        "optax.microbatching": optax.microbatching.microbatch(
            grad,
            argnums=1,
            microbatch_size=rows // K,
            accumulator=optax.microbatching.AccumulationType.MEAN,
        ),
        "microbatched": optax_ext.microbatched(grad, K),
        'microbatched(axis_name="fsdp")': optax_ext.microbatched(
            grad, K, axis_name="fsdp"
        ),
    }
    temps = {}
    for name, fn in candidates.items():
        try:
            with jax.set_mesh(mesh):
                out = [p.sharding for p in params]
                compiled = jax.jit(fn, out_shardings=out).lower(params, batch).compile()
            temps[name] = compiled.memory_analysis().temp_size_in_bytes
        except Exception as e:  # noqa: BLE001 (a candidate that fails is reported)
            temps[name] = f"fails: {type(e).__name__}"
    per_device = sum(p.addressable_shards[0].data.nbytes for p in params)
    full = temps["full batch"]
    cells = {}
    for name, t in temps.items():
        if isinstance(t, str):
            cells[name] = t
        else:
            cells[name] = f"{t / 2**20:.1f} MiB ({t / full:.2f})"
    return cells, per_device


def main(name: str = "sharded") -> None:
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].platform} ({jax.device_count()} simulated devices), "
        f"jax {jax.__version__}, optax {optax.__version__}, optax_ext at "
        f"{code_version()}. Compiled memory "
        "(`memory_analysis()`), XLA:CPU; no timing.",
        "",
        "## MultiSteps train step with FSDP params",
        "",
        f"Params: {LEAVES} leaves of {SHAPE} float32 split on their first axis "
        "over the 8 devices of the mesh axis `fsdp`, gradients alike; the train "
        "step (`update` + `apply_updates`, or `apply_gradients`) jitted with "
        f"params and state donated, inner Adam or Lion, a mini-step of a {WINDOW}-step "
        "window. Temporary memory per device in units of the params per device, "
        "and the copies of a params shard in the compiled HLO.",
        "",
        "| inner | mesh axes | bare | optax.MultiSteps | optax_ext drop-in "
        "| optax_ext apply_gradients |",
        "|---|---|---|---|---|---|",
    ]
    for inner in ("adam", "lion"):
        for mode in MODES:
            cells = train_step_row(mode, inner)
            lines.append(f"| {inner} | {mode} | " + " | ".join(cells.values()) + " |")
    lines += [
        "",
        "The drop-in form's 1.00 is its zero updates, as on one device. A copy "
        "of Lion's moment is what its order (`docs/design.md`) cannot prevent "
        "where no token can read a shard (`Explicit` axes) or, before jaxlib "
        "0.11, where fusion recomputes the update the token reads.",
        "",
        "## microbatched with FSDP params",
        "",
        "`jax.grad` of a mean loss of an MLP (gelu) whose params are split on "
        "their first axis over the 8 devices of `fsdp`, the batch split over "
        f"`fsdp` too, k = {K} micro-batches, jitted with the gradients sharded "
        "as the params. Temporary memory per device, and in brackets its ratio "
        "to the full batch's. With `Auto` axes the params' sharding is not in "
        'their type: `axis_name="fsdp"` there takes them as replicated over it '
        "(data parallelism) and gathers them whole before the loop; leave it "
        "out for FSDP params.",
        "",
        "| model | mesh axes | params per device | full batch "
        '| optax.microbatching | microbatched | microbatched(axis_name="fsdp") |',
        "|---|---|---|---|---|---|---|",
    ]
    for model, sizes in MLPS.items():
        for mode in MODES:
            cells, per_device = microbatched_row(mode, sizes)
            lines.append(
                f"| {model} | {mode} | {per_device / 2**20:.1f} MiB | "
                + " | ".join(cells.values())
                + " |"
            )
    lines += [
        "",
        "optax 0.2.8's `microbatch` fails to reshape the batch under `Explicit` "
        "axes (`ShardingTypeError`: the reshape needs an `out_sharding`). "
        "`microbatched`'s excess over the full batch, where there is one, is the "
        "micro-batch's rows sliced out of the batch (64 KiB per device for the "
        "params-dominated MLP) and the loop's own few bytes.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else "sharded")
