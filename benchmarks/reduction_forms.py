"""Where a chain that reads the window's mean twice (`clip_by_global_norm`
then Adam-W) leaves the mean, and what each backend then needs.

    .venv-deviceless/bin/python benchmarks/reduction_forms.py

(the environment of `tests/data/deviceless-requirements.txt`) compiles,
for the GPT-2-like tree of `tests/test_compiled_backends.py` in float32,
window of 4, params and state donated, six train steps for XLA:CPU, an
H200 and a TPU v5e, and writes `benchmarks/results/reduction_forms.md`:
the conditionals kept and the temporary memory over the params' bytes;
and on XLA:CPU alone, for SGD with Nesterov momentum, Adafactor, Adam and
Lion on 8 leaves of (1000, 500), three of the forms.

- `bare`: the inner chain's own step;
- `bare in cond`: that step inside a `lax.cond` (what the conditional costs);
- `optax_ext fused`: `apply_gradients` as each backend gets it with jax
  0.11: on XLA:CPU and XLA:TPU the running mean folded into the
  accumulator before the conditional, which reads it as a buffer, the
  reset ordered after it; on XLA:GPU the mean computed in the running
  branch;
- `optax_ext, branch folds`: `apply_gradients` with the mean computed in
  the running branch on every backend (the form of XLA:CPU before jaxlib
  0.11);
- `mean folded before`: the fold before the conditional, its reset not
  ordered after it;
- `accumulator through`: the accumulator an operand and a result of the
  conditional (the fold in the idle branch, zeros in the running one).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import _compiled  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import test_compiled_backends as t  # noqa: E402
from jax import lax  # noqa: E402
from run import machine  # noqa: E402

import optax_ext  # noqa: E402
from optax_ext._accumulate import window  # noqa: E402

K = 4


def _fold(a, g, n):
    return a + (g - a) / n.astype(a.dtype)


def forms(tx):
    """name: (step, init)."""

    def bare(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run(grads, inner, params):
        updates, inner = tx.update(grads, inner, params)
        return optax.apply_updates(params, updates), inner

    def bare_in_cond(params, state, grads):
        n, inner = state
        params, inner = lax.cond(
            n + 1 == K, run, lambda g, s, p: (p, s), grads, inner, params
        )
        return params, ((n + 1) % K, inner)

    def folded_before(params, state, grads):
        n, acc, inner = state
        acc = jax.tree.map(lambda a, g: _fold(a, g, n + 1), acc, grads)
        params, inner = lax.cond(
            n + 1 == K, run, lambda g, s, p: (p, s), acc, inner, params
        )
        acc = jax.tree.map(lambda a: jnp.where(n + 1 == K, 0, a), acc)
        return params, ((n + 1) % K, acc, inner)

    def through(params, state, grads):
        n, acc, inner = state

        def emit(g, acc, inner, params):
            mean = jax.tree.map(lambda a, g: _fold(a, g, n + 1), acc, g)
            params, inner = run(mean, inner, params)
            return params, inner, jax.tree.map(jnp.zeros_like, acc)

        def idle(g, acc, inner, params):
            acc = jax.tree.map(lambda a, g: _fold(a, g, n + 1), acc, g)
            return params, inner, acc

        params, inner, acc = lax.cond(n + 1 == K, emit, idle, grads, acc, inner, params)
        return params, ((n + 1) % K, acc, inner)

    ms = optax_ext.MultiSteps(tx, K)

    def branch_folds(params, state, grads):
        kept = window.folds_in_branch
        window.folds_in_branch = lambda: True  # while this step is traced
        try:
            return optax_ext.apply_gradients(ms, grads, state, params)
        finally:
            window.folds_in_branch = kept

    counter = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    zeros = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
    return {
        "bare": (bare, tx.init),
        "bare in cond": (bare_in_cond, lambda p: (counter(), tx.init(p))),
        "optax_ext fused": (
            lambda p, s, g: optax_ext.apply_gradients(ms, g, s, p),
            ms.init,
        ),
        "optax_ext, branch folds": (branch_folds, ms.init),
        "mean folded before": (
            folded_before,
            lambda p: (counter(), zeros(p), tx.init(p)),
        ),
        "accumulator through": (through, lambda p: (counter(), zeros(p), tx.init(p))),
    }


CPU_FORMS = ("bare", "optax_ext fused", "optax_ext, branch folds")
CPU_INNER = {
    "sgd nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda: optax.adafactor(1e-3),
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "clip+adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
}


def main() -> None:
    backends = [b for b in t.BACKENDS if _compiled.unavailable(b) is None]
    params = t.LAYOUTS["gpt2-like"](jnp.float32)
    size = t._bytes(params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    lines = [
        "# Where a twice-read window mean is left",
        "",
        "Written by `benchmarks/reduction_forms.py`. Measured on: "
        f"{machine()}. GPU: an H200 target, TPU: a v5e, compiled deviceless. "
        "clip_by_global_norm + adamw, GPT-2-like tree (148 leaves), float32, "
        "window of 4; conditionals kept, temporary memory over the params' "
        "bytes.",
        "",
        "| form | " + " | ".join(b.upper() for b in backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for name, (step, init) in forms(tx).items():
        cells = []
        for backend in backends:
            compiled = _compiled.compile_step(
                backend, step, params, init(params), params
            )
            got = _compiled.report(compiled, set(), ("sqrt",))
            cells.append(f"{got['conditionals']} cond, {got['temp'] / size:.3f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "XLA:CPU, 8 leaves of (1000, 500), float32: other inner optimizers "
        "that read the mean more than once (temporary memory over the params' "
        "bytes).",
        "",
        "| inner | " + " | ".join(CPU_FORMS) + " |",
        "|---|" + "---|" * len(CPU_FORMS),
    ]
    params = {f"w{i}": jnp.zeros((1000, 500)) for i in range(8)}
    size = t._bytes(params)
    for name, make in CPU_INNER.items():
        made = forms(make())
        cells = []
        for form in CPU_FORMS:
            step, init = made[form]
            compiled = _compiled.compile_step("cpu", step, params, init(params), params)
            temp = compiled.memory_analysis().temp_size_in_bytes
            cells.append(f"{temp / size:.3f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "reduction_forms.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
