"""Why the fused step with bfloat16 params and a float32 accumulator holds
every gradient at once on an H200, and the host-chosen mini-step does
not: XLA:GPU's memory scheduler, read from its own log.

    .venv-deviceless/bin/python benchmarks/investigations/scheduler_tie.py [--out FILE]

Compiles the whole train step of `tests/test_train_step_memory.py` (its
MLP of 4 x (1024, 1024), adamw, `apply_gradients`) for the H200 target,
deviceless, with the float32 and the bfloat16 (`accumulator_dtype=None`)
accumulator, and the float32 one in the host-chosen mini-step (`emit=False`,
no conditional), each in a child process whose XLA logs its scheduler
(`TF_CPP_VMODULE=hlo_memory_scheduler=2`). For the train step's module it
prints the peak each of the scheduler's three orders simulates, the order
kept, and where the list order puts the matmuls (`gemm_fusion_dot`: the
first seven are the forward's and the activation gradients', the last four
the weight gradients) and the folds (the fusions that read the
accumulator), with the bytes each frees by the list order's own count
(negative: it defines more than it frees).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parents[1] / "tests"
CASES = [("float32", "fused"), ("bfloat16", "fused"), ("float32", "emit=False")]


def child(accumulator: str, form: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(TESTS))
    import jax
    import jax.numpy as jnp
    import test_train_step_memory as ts

    import optax_ext

    params, loss, batch = ts._mlp(jnp.bfloat16)
    acc = None if accumulator == "bfloat16" else jnp.float32
    opt = optax_ext.MultiSteps(ts.INNER["adamw"][0](), ts.K, accumulator_dtype=acc)
    state = jax.eval_shape(opt.init, params)
    step = ts.train_step(opt, form, loss, [])
    compiled = ts.compile_train_step("gpu", step, params, state, batch, [])
    temp = compiled.memory_analysis().temp_size_in_bytes / ts._bytes(params)
    print(f"TEMP {temp:.3f}", flush=True)
    entry = compiled.as_text().split("\nENTRY ")[1]
    kept = []
    for line in entry.splitlines():
        m = re.match(r"\s*%?(\S+) = \S+ fusion\((.*?)\)", line)
        if m and m.group(1).startswith("gemm_fusion_dot"):
            kept.append("matmul")
        elif m and "acc_grads" in m.group(2):
            kept.append("fold")
    print(f"KEPT {', '.join(kept)}", flush=True)


def report(accumulator: str, form: str) -> list[str]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="0",
        TF_CPP_VMODULE="hlo_memory_scheduler=2,gpu_hlo_schedule=2",
    )
    run = subprocess.run(
        [sys.executable, __file__, "--child", accumulator, "--form", form],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    log = run.stderr.splitlines()
    start = max(i for i, line in enumerate(log) if "for module jit_step" in line)
    peaks, chosen, order = [], "", []
    for line in log[start:]:
        if m := re.search(r"Min-memory (.+?) sequence: (\S+)", line):
            peaks.append(f"{m.group(1)} {m.group(2)}")
        if m := re.search(r"Chose min-memory (.+?) sequence", line):
            chosen = m.group(1)
            break
        m = re.search(
            r"Schedule instruction: %(\S+) = fusion\((.*)\) Bytes freed: (-?\d+)",
            line,
        )
        if m and m.group(1).startswith("gemm_fusion_dot"):
            order.append(f"matmul {m.group(1)} ({m.group(3)})")
        elif m and "state_acc_grads" in m.group(2):
            order.append(f"fold {m.group(1)} ({m.group(3)})")
    temp = re.search(r"TEMP (\S+)", run.stdout).group(1)
    return [
        f"### {accumulator} accumulator, {form}",
        "",
        f"- temporary memory: {temp}x the params",
        f"- simulated peak per order: {', '.join(peaks)}; kept: {chosen}",
        "- the kept order's matmuls and folds, from the scheduled HLO: "
        + re.search(r"KEPT (.*)", run.stdout).group(1),
        f"- the list order, matmuls and folds (bytes freed): {', '.join(order)}",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--form", default="fused")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.form)
        return
    import jax

    lines = [
        "# XLA:GPU's memory scheduler on the bfloat16 step",
        "",
        "Written by `benchmarks/investigations/scheduler_tie.py`, "
        f"jax {jax.__version__}, H200 target, deviceless.",
        "",
    ]
    for accumulator, form in CASES:
        lines += report(accumulator, form)
    text = "\n".join(lines)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
