"""What XLA:CPU, XLA:GPU (an H200) and XLA:TPU (a v5e) compile for the
train steps of `tests/test_compiled_backends.py`, case by case.

    .venv-deviceless/bin/python benchmarks/deviceless.py

(the environment of `tests/data/deviceless-requirements.txt`) writes
`benchmarks/results/deviceless.md`: for each layout, inner optimizer,
dtype and form, whether the conditional is kept (no op of the inner
optimizer outside a branch), the copies of a params-leaf-sized array on
every step and inside the emitting branch, the temporary memory over the
params' bytes against the bare inner optimizer's train step, and whether
the test's bound holds. Exact: compiled, not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import _compiled  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax)
import test_compiled_backends as t  # noqa: E402
from run import machine  # noqa: E402


def main() -> None:
    backends = [b for b in t.BACKENDS if _compiled.unavailable(b) is None]
    lines = [
        "# What each backend compiles for the train step",
        "",
        "Written by `benchmarks/deviceless.py`. Measured on: "
        f"{machine()}. GPU: an H200 target, TPU: a v5e, compiled deviceless. "
        "`kept`: the conditional stays and no op of the inner optimizer is "
        "outside it; copies of a params-leaf-sized array (2**16 elements or "
        "more) on every step + inside the emitting branch; temporary memory "
        "over the params' bytes, ours / the bare inner optimizer's train "
        "step; `ok`: within `test_compiled_backends.temp_bound`.",
        "",
        "| layout | inner | dtype | form | "
        + " | ".join(b.upper() for b in backends)
        + " |",
        "|---|---|---|---|" + "---|" * len(backends),
    ]
    for case in t.CASES:
        layout, inner, dtype = case.values
        for form in ("fused", "drop-in"):
            cells = []
            for backend in backends:
                got = t._compiled(backend, layout, inner, dtype, form)
                bare = t._compiled(backend, layout, inner, dtype, "bare")
                p = got["params"]
                bound = t.temp_bound(backend, inner, dtype, form, bare["temp"], p)
                kept = got["conditionals"] >= 1 and got["markers_outside"] == 0
                cells.append(
                    f"{'kept' if kept else 'GONE'}, "
                    f"{len(got['copies'])}+{len(got['branch_copies'])} copies, "
                    f"{got['temp'] / p:.3f} / {bare['temp'] / p:.3f}x "
                    f"{'ok' if got['temp'] <= bound else 'OVER'}"
                )
            lines.append(
                f"| {layout} | {inner} | {dtype} | {form} | " + " | ".join(cells) + " |"
            )
            print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "deviceless.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
