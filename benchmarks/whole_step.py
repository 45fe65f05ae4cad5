"""The temporary memory of the train step users write (a loss, `jax.grad`
and the optimizer step in one `jax.jit`, params and state donated), for
each optax_ext form beside `optax.MultiSteps` and the bare optimizer,
compiled the same way: for XLA:CPU with the JAX installed, and for an
H200 and a TPU v5e deviceless where run in `.venv-deviceless`.

    python benchmarks/whole_step.py [--backends cpu gpu tpu] [--out FILE]

The steps and models are those of `tests/test_train_step_memory.py`,
which asserts the bound; this prints the figures, at the sizes of the
issue that asked for them (an MLP of 4 x (2048, 2048), batch 8).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import test_train_step_memory as ts  # noqa: E402
from _compiled import unavailable  # noqa: E402

import optax_ext  # noqa: E402

COLUMNS = ["bare", "optax", "drop-in", "fused", "emit=False", "emit=True"]
MLP = "mlp 4 x (2048, 2048), batch 8"
GPT = "gpt2-like, 2 layers of width 256"
WIDE = "gpt2-like, 6 layers of width 512, sequence 128"
# (model, dtype, inner, the accumulator_dtype of optax_ext's forms)
CASES = [
    (MLP, "float32", "adamw", jnp.float32),
    (MLP, "float32", "lion", jnp.float32),
    (MLP, "float32", "clip+adamw", jnp.float32),
    (MLP, "bfloat16", "adamw", jnp.float32),
    (MLP, "bfloat16", "adamw", None),
    (GPT, "float32", "adamw", jnp.float32),
    (GPT, "float32", "clip+adamw", jnp.float32),
    (WIDE, "float32", "adamw", jnp.float32),
    (WIDE, "float32", "clip+adamw", jnp.float32),
]


def _model(name, dtype):
    if name == MLP:
        return ts._mlp(dtype, width=2048, depth=4, batch=8)
    if name == WIDE:
        return ts._gpt(dtype, d=512, layers=6, heads=8, vocab=4096, seq=128)
    return ts._gpt(dtype)


def ratio(backend, model, dtype, inner, accumulator, form):
    params, loss, batch = _model(model, jnp.dtype(dtype))
    tx = ts.INNER[inner][0]()
    opt = {"bare": tx, "optax": optax.MultiSteps(tx, ts.K)}.get(form)
    opt = opt or optax_ext.MultiSteps(tx, ts.K, accumulator_dtype=accumulator)
    state = jax.eval_shape(opt.init, params)
    step = ts.train_step(opt, form, loss, [])
    compiled = ts.compile_train_step(backend, step, params, state, batch, [])
    return compiled.memory_analysis().temp_size_in_bytes / ts._bytes(params)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["cpu", "gpu", "tpu"])
    parser.add_argument("--out")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    ).stdout.strip()
    lines = [
        f"Written by `benchmarks/whole_step.py`. jax {jax.__version__}, "
        f"optax {optax.__version__}, Python {platform.python_version()}; "
        f"optax_ext at commit {commit}. GPU: an H200 target, TPU: a v5e, "
        "compiled deviceless. The whole train step's temporary memory over "
        "the params' bytes, every_k 4.",
        "",
        "| backend | model | dtype | inner | " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * (4 + len(COLUMNS)),
    ]
    for backend in args.backends:
        why = unavailable(backend)
        if why:
            print(f"{backend}: skipped ({why})", file=sys.stderr)
            continue
        name = {"cpu": f"XLA:CPU (jax {jax.__version__})", "gpu": "H200"}
        name = name.get(backend, "TPU v5e")
        for model, dtype, inner, acc in CASES:
            cells = [
                f"{ratio(backend, model, dtype, inner, acc, f):.3f}" for f in COLUMNS
            ]
            if acc is None:
                inner += ", accumulator_dtype=None"
            row = f"| {name} | {model} | {dtype} | {inner} | " + " | ".join(cells)
            lines.append(row + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        pathlib.Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
