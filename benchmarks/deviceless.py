"""What XLA:CPU, XLA:GPU (an H200) and XLA:TPU (a v5e) compile for the
train steps of `tests/test_compiled_backends.py`, case by case.

    .venv-deviceless/bin/python benchmarks/deviceless.py

(the environment of `tests/data/deviceless-requirements.txt`) writes
`benchmarks/results/deviceless.md`: for each layout, inner optimizer,
dtype and form, whether the conditional is kept (no op of the inner
optimizer outside a branch), the copies of a params-leaf-sized array on
every step and inside the emitting branch, the temporary memory over the
params' bytes against the bare inner optimizer's train step, and whether
the test's bound holds; the same for the host-chosen steps
(`apply_gradients(..., emit=)`), where there is no conditional; and the
FSDP step of `test_fsdp_step_per_device` (Adam-W, 4 leaves of
(1024, 1024) split over 4 H200s or a v5e 2x2), per device, for each
partitioner and mesh axis; and each form's device cost (the GPU's
bytes, the TPU's estimated cycles) against optax.MultiSteps'. Exact:
compiled, not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import _compiled  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax)
import test_compiled_backends as t  # noqa: E402
from _timing import machine  # noqa: E402


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
        *_table_head(backends),
    ]
    for case in t.CASES:
        layout, inner, dtype = case.values
        for form in ("fused", "drop-in"):
            lines.append(_row(backends, layout, inner, dtype, form))
            print(lines[-1], flush=True)
    lines += [
        "",
        "## Chosen on the host",
        "",
        "`apply_gradients(..., emit=False)` (a mini-step) and `emit=True` (the "
        "emitting step), as `test_host_chosen_steps_hold_no_conditional` "
        "compiles them: the conditionals left (a nested MultiSteps keeps its "
        "own), copies, temporary memory as above; `ok`: `emit=False` within "
        "2% of the params, `emit=True` within `temp_bound`.",
        "",
        *_table_head(backends),
    ]
    for case in t.CASES:
        layout, inner, dtype = case.values
        if layout != "4 large" and (
            inner not in ("adamw", "clip+adamw") or dtype != "float32"
        ):
            continue
        for form in ("emit=False", "emit=True"):
            lines.append(_row(backends, layout, inner, dtype, form))
            print(lines[-1], flush=True)
    lines += _cost_section([b for b in backends if b != "cpu"])
    lines += _fsdp_section([b for b in backends if b != "cpu"])
    out = ROOT / "benchmarks" / "results" / "deviceless.md"
    out.write_text("\n".join(lines) + "\n")


def _table_head(backends: list[str]) -> list[str]:
    names = " | ".join(b.upper() for b in backends)
    return [
        f"| layout | inner | dtype | form | {names} |",
        "|" + "---|" * (4 + len(backends)),
    ]


def _row(backends: list[str], layout: str, inner: str, dtype: str, form: str) -> str:
    cells = []
    for backend in backends:
        got = t._compiled(backend, layout, inner, dtype, form)
        bare = t._compiled(backend, layout, inner, dtype, "bare")
        p = got["params"]
        if form.startswith("emit="):
            head = f"{got['conditionals']} cond"
            bound = 0.02 * p
            if form == "emit=True":
                bound = t.temp_bound(backend, inner, dtype, form, bare["temp"], p)
        else:
            kept = got["conditionals"] >= 1 and got["markers_outside"] == 0
            head = "kept" if kept else "GONE"
            bound = t.temp_bound(backend, inner, dtype, form, bare["temp"], p)
        cells.append(
            f"{head}, "
            f"{len(got['copies'])}+{len(got['branch_copies'])} copies, "
            f"{got['temp'] / p:.3f} / {bare['temp'] / p:.3f}x "
            f"{'ok' if got['temp'] <= bound else 'OVER'}"
        )
    return f"| {layout} | {inner} | {dtype} | {form} | " + " | ".join(cells) + " |"


def _cost_section(backends: list[str]) -> list[str]:
    lines = [
        "",
        "## Device cost per form",
        "",
        "The optimizer step of `_compiled` (gradients passed in, params and "
        "state donated), the GPT-2-like tree, float32, against "
        "optax.MultiSteps' step: on the GPU the bytes its kernels read and "
        "write, on the TPU the cycles XLA:TPU's cost model estimates "
        "(`estimated_cycles`, summed; `tests/_compiled.step_cost`). A "
        "cell: mini-step / emitting step / window of 4, over optax's.",
        "",
        "| backend | inner | optax | drop-in | fused | emit=False | emit=True |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in backends:
        for inner in ("adamw", "lion"):
            forms = ("optax", "drop-in", "fused", "emit=False", "emit=True")
            cost = {
                f: t._compiled(backend, "gpt2-like", inner, "float32", f)["cost"]
                for f in forms
            }
            ref = cost["optax"][0]
            cells = [f"{ref:,} {'cycles' if backend == 'tpu' else 'bytes'}"]
            for f in forms[1:]:
                mini, emitting = cost[f]
                win = (3 * mini + emitting) / 4
                cells.append(
                    f"{mini / ref:.3f} / {emitting / ref:.3f} / {win / ref:.3f}"
                )
            lines.append(f"| {backend.upper()} | {inner} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def _fsdp_section(backends: list[str]) -> list[str]:
    lines = [
        "",
        "## FSDP under `jax.jit`, per device",
        "",
        "Adam-W, float32, 4 leaves of (1024, 1024) split on their first axis "
        "over 4 devices (4 H200s; a v5e 2x2), params, state and gradients "
        "sharded alike (`test_fsdp_step_per_device`). A cell: all-gathers / "
        "copies of a shard or a gathered leaf / temporary memory over the "
        "per-device params. `plain cond`: the bare step inside one "
        "`lax.cond`. `out_shardings given`: `jax.jit(..., out_shardings=)` "
        "the new params and state as they came, as FSDP loops give them; "
        "elsewhere the partitioner chooses.",
        "",
        "| backend | partitioner, mesh axis | bare | plain cond | fused | "
        "drop-in | emit=False | emit=True |",
        "|---|---|---|---|---|---|---|---|",
    ]
    settings = {
        "Shardy, Auto": (True, False, False),
        "Shardy, Auto, out_shardings given": (True, False, True),
        "Shardy, Explicit": (True, True, False),
        "GSPMD, Auto": (False, False, False),
    }
    for backend in backends:
        for name, (shardy, explicit, pinned) in settings.items():
            cells = []
            for form in (
                "bare",
                "plain cond",
                "fused",
                "drop-in",
                "emit=False",
                "emit=True",
            ):
                got = t._fsdp(backend, form, shardy, explicit, pinned)
                copies = len(got["copies"]) + len(got["branch_copies"])
                cells.append(
                    f"{got['gathers']} / {copies} / "
                    f"{got['temp'] / got['per_device']:.3f}x"
                )
            lines.append(f"| {backend.upper()} | {name} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
