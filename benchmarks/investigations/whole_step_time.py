"""The time of the train step users write (a loss, `jax.grad` and the
optimizer step in one `jax.jit`, params and state donated), each form
beside `optax.MultiSteps` and the bare optimizer, on the device JAX
picks (the CPU here; `benchmarks/gpu_check.py` runs the same on a GPU).

    python benchmarks/investigations/whole_step_time.py [--rounds N] [--out FILE]
        [--append] [--model mlp|decoder] [--dtypes float32 bfloat16]

The steps, the model (an MLP of 4 x (2048, 2048), batch 8, float32 and
bfloat16, `optax.adamw`) and the timing are `gpu_check.py`'s: every
program compiled first, then windows of 4 steps timed from a host loop,
one timing of each form per round in a shuffled order, medians over the
rounds. `benchmarks/whole_step.py` gives the same steps' memory on each
backend. `--model decoder`: the GPT-2-like decoder of `whole_step.py
--cases decoder` instead (4 layers of width 256, 4 heads, sequence 128,
batch 8, vocabulary 4096), whose activations dominate.

*microbatched*: `optax_ext.microbatched(jax.grad(loss), 4)` on a global
batch of 4 of the model's batches, then the bare `adamw`'s `update` and
`optax.apply_updates`, in one `jax.jit`: one call a window, timed
interleaved with the others; its "ms per step" is its call's time over 4.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "tests")]
import gpu_check  # noqa: E402
import test_train_step_memory as ts  # noqa: E402
from _timing import machine  # noqa: E402

import optax_ext  # noqa: E402

MODELS = {
    "mlp": (gpu_check.mlp, "an MLP of 4 x (2048, 2048) with a batch of 8"),
    "decoder": (
        lambda dtype, quick: ts._gpt(
            jnp.dtype(dtype), d=256, layers=4, heads=4, vocab=4096, seq=128, batch=8
        ),
        "a GPT-2-like decoder of 4 layers of width 256, 4 heads, sequence "
        "128, batch 8 and a vocabulary of 4096",
    ),
}


def microbatched(params, loss, batch) -> dict:
    """The `microbatched` form for `gpu_check.whole_case`: one step, taking
    a global batch of `WINDOW` of the model's batches, per window."""
    tx = gpu_check.INNER()
    grads = optax_ext.microbatched(jax.grad(loss), gpu_check.WINDOW)

    def step(params, state, global_batch):
        updates, state = tx.update(grads(params, global_batch), state, params)
        return optax.apply_updates(params, updates), state

    global_batch = jnp.concatenate([batch] * gpu_check.WINDOW)
    return {"microbatched": (tx.init, [step], global_batch)}


def _load() -> str:
    """The 1-minute load average, where `/proc/loadavg` gives it."""
    try:
        return pathlib.Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--steps", type=int, default=16, help="steps per timing (whole windows)"
    )
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--append", action="store_true", help="append to --out")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--dtypes", nargs="+", default=gpu_check.WHOLE_CASES)
    args = parser.parse_args()
    model, described = MODELS[args.model]
    device = jax.devices()[0]
    steps = gpu_check.whole_windows(args.steps)
    load = _load()
    lines = [
        f"# The whole train step's time on {device.platform.upper()}",
        "",
        f"Written by `benchmarks/investigations/whole_step_time.py`. {machine()}. "
        "Device: "
        f"{device.device_kind}. The whole train step (loss, `jax.grad` and the "
        f"step in one `jax.jit`, params and state donated) of {described}, "
        "`optax.adamw(1e-4)`, windows of "
        f"{gpu_check.WINDOW}: ms per step over {steps} steps from a host "
        f"loop, the median of {args.rounds} interleaved rounds; `optax / form`: "
        "above 1, the form is faster. Temporary MiB and compiled peak MiB "
        "(arguments + outputs not aliased + temporaries) from "
        "`memory_analysis()`. *bare*: the inner optimizer's own step, "
        "updating on every step. *microbatched*: one call a window, on a "
        f"global batch of {gpu_check.WINDOW} batches (`microbatched(jax.grad("
        f"loss), {gpu_check.WINDOW})`, then the bare optimizer's step); ms per "
        f"step: its call over {gpu_check.WINDOW}, so `optax / form` is optax's "
        "window over its call.",
        "",
    ]
    for dtype in args.dtypes:
        print(f"{dtype}:", flush=True)
        case = gpu_check.whole_case(
            dtype, False, steps, args.rounds, model, extra=microbatched
        )
        lines += [
            f"## {dtype}, jax {jax.__version__}",
            "",
            *gpu_check.whole_table(case),
        ]
    lines += [
        f"Load average (1 minute) at the start: {load}, at the end: {_load()}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out and args.append:
        with args.out.open("a") as out:
            out.write("\n" + text + "\n")
    elif args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
