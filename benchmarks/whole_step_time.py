"""The time of the train step users write (a loss, `jax.grad` and the
optimizer step in one `jax.jit`, params and state donated), each form
beside `optax.MultiSteps` and the bare optimizer, on the device JAX
picks (the CPU here; `gpu_check.py` runs the same on a GPU).

    python benchmarks/whole_step_time.py [--rounds N] [--out FILE]

The steps, the model (an MLP of 4 x (2048, 2048), batch 8, float32 and
bfloat16, `optax.adamw`) and the timing are `gpu_check.py`'s: every
program compiled first, then windows of 4 steps timed from a host loop,
one timing of each form per round in a shuffled order, medians over the
rounds. `benchmarks/whole_step.py` gives the same steps' memory on each
backend.
"""

from __future__ import annotations

import argparse
import pathlib

import gpu_check
import jax
from run import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--steps", type=int, default=16, help="steps per timing (whole windows)"
    )
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    device = jax.devices()[0]
    steps = gpu_check.whole_windows(args.steps)
    lines = [
        f"# The whole train step's time on {device.platform.upper()}",
        "",
        f"Written by `benchmarks/whole_step_time.py`. {machine()}. Device: "
        f"{device.device_kind}. The whole train step (loss, `jax.grad` and the "
        "step in one `jax.jit`, params and state donated) of an MLP of "
        "4 x (2048, 2048) with a batch of 8, `optax.adamw(1e-4)`, windows of "
        f"{gpu_check.WINDOW}: ms per step over {steps} steps from a host "
        f"loop, the median of {args.rounds} interleaved rounds; `optax / form`: "
        "above 1, the form is faster. Temporary MiB and compiled peak MiB "
        "(arguments + outputs not aliased + temporaries) from "
        "`memory_analysis()`. *bare*: the inner optimizer's own step, "
        "updating on every step.",
        "",
    ]
    for dtype in gpu_check.WHOLE_CASES:
        print(f"{dtype}:", flush=True)
        case = gpu_check.whole_case(dtype, False, steps, args.rounds)
        lines += [
            f"## {dtype}, jax {jax.__version__}",
            "",
            *gpu_check.whole_table(case),
        ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
