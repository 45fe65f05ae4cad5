"""What each mechanism of `update_if` buys: each switched off in turn.

Run with `python benchmarks/mechanisms.py` (`--quick` for a smoke run that
writes nothing); it writes `benchmarks/results/mechanisms.md`, the table
behind `docs/design.md`'s "What each mechanism costs and buys".

Each case (inner optimizer, params layout) runs in a fresh process. Every
variant is `optax_ext.MultiSteps`, compiled in two forms: the drop-in step
(`update` + `optax.apply_updates`) and the fused one (`apply_gradients`),
each as a mini-step and as an emitting step, params and state donated. A
variant replaces one mechanism by its plain form while the step is traced
(the patch is undone before the next variant is built), so all variants
are compiled first and then timed round-robin in one process, as in
`train_step.py`. `plain` is `train_step.plain_multi_steps`, the ~40-line
MultiSteps with one `lax.cond` and none of the mechanisms.

Reported: compiled temporary memory (`memory_analysis()`), the number of
copies in the compiled module of an array at least as large as one params
leaf, and the median ms per step, for each variant against `all` (every
mechanism on).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax

import optax_ext
from optax_ext import _conditional, _dataflow, _ordering, _sharding

sys.path.insert(0, str(Path(__file__).parent))
from run import machine, time_interleaved  # noqa: E402
from train_step import LAYOUTS, NEVER, make_params, plain_multi_steps  # noqa: E402

RESULTS = Path(__file__).parent / "results"

INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "sgd nesterov": lambda: optax.sgd(1e-3, momentum=0.9, nesterov=True),
    "adafactor": lambda: optax.adafactor(1e-3),
    # A nested conditional: the inner MultiSteps emits on every step (k=1).
    "MultiSteps(lion, 1)": lambda: optax_ext.MultiSteps(optax.lion(1e-4), 1),
    # A nested conditional on a flag XLA folds (no `skip=` passed).
    "skip_when(lion)": lambda: optax_ext.skip_when(optax.lion(1e-4)),
}
# The compositions run on one large and one small layout; the plain inner
# optimizers on all of `LAYOUTS`.
COMPOSED = ("MultiSteps(lion, 1)", "skip_when(lion)")


def _no_state_order(update_leaves, state_leaves, readers, pred):
    return list(state_leaves), set(), set()


def _no_nested_select(grad_readers, state_leaves, ordered, followed, n_updates, pred):
    to_read, reading = grad_readers, set(grad_readers)
    if any(
        n_updates + i in reading and _ordering.readable(state_leaves[i])
        for i in ordered
    ):
        to_read = [i for i in grad_readers if i not in followed]
    return to_read


def _plain_zeros(structs, pred):
    return jax.tree.map(_sharding.zeros_like_struct, structs)


def _jit_not_inlined(fun, **kwargs):
    return jax.jit(fun, **{**kwargs, "inline": False})


# name -> what is replaced, as (module, attribute, replacement) triples.
VARIANTS: dict[str, tuple[tuple[object, str, Callable[[], object]], ...]] = {
    "all": (),
    # The same program compiled again: its spread against `all` is the
    # noise of the timing.
    "all again": (),
    "no state order": ((_conditional, "order_state_writes", lambda: _no_state_order),),
    "no clear order": (
        (_conditional, "read_token", lambda: lambda arrays, pred: None),
    ),
    "no ordering": (
        (_conditional, "order_state_writes", lambda: _no_state_order),
        (_conditional, "read_token", lambda: lambda arrays, pred: None),
    ),
    "no nested select": (
        (_conditional, "outputs_before_clear", lambda: _no_nested_select),
    ),
    "no tagged zeros": ((_conditional, "_distinct_zeros", lambda: _plain_zeros),),
    "no opaque pred": ((_conditional, "opaque_true", lambda: lambda leaves: None),),
    "no inline": (
        (
            _conditional,
            "jax",
            lambda: SimpleNamespace(
                **{
                    **{k: getattr(jax, k) for k in dir(jax) if not k.startswith("__")},
                    "jit": _jit_not_inlined,
                }
            ),
        ),
    ),
}


# variant -> (what it removes, the code that would go with it).
MECHANISMS: dict[str, tuple[str, tuple[Callable, ...]]] = {
    "no state order": (
        "state writes ordered after the updates' reads (Lion's `mu`)",
        (
            _ordering.order_state_writes,
            _ordering.orderable,
            _dataflow.state_read_by_updates,
        ),
    ),
    "no clear order": (
        "the accumulator's clear ordered after the inner update's reads",
        (
            _ordering.outputs_before_clear,
            _ordering.zeros_in_place,
            _dataflow.grad_readers,
        ),
    ),
    "no ordering": (
        "both orderings, the tokens and the jaxpr analysis",
        (
            _ordering.read_token,
            _ordering.select_on,
            _ordering.readable,
            _ordering.bit_width,
            _ordering._first_bits,
            _ordering._always_true,
            _ordering._all_true_of,
            _ordering._true_after_reading,
            _dataflow.flow,
            _dataflow._eqn_flow,
            _dataflow._inner_adjust,
            _dataflow._marks,
        ),
    ),
    "no nested select": (
        "the select on a nested conditional's state leaf before the clear",
        (),
    ),
    "no tagged zeros": (
        "zeros of its own for each large leaf in the idle branch",
        (_conditional._distinct_zeros, _conditional._tagged_zeros),
    ),
    "no opaque pred": (
        "a predicate XLA cannot fold (`opaque_true`)",
        (_ordering.opaque_true,),
    ),
    "no inline": ("the inner step's trace inlined into the branch", ()),
}

# Lines of mechanisms that live inside another function.
INLINE_LINES = {"no nested select": 6, "no inline": 1}


def code_lines(variant: str) -> int:
    if variant in INLINE_LINES:
        return INLINE_LINES[variant]
    return sum(len(inspect.getsourcelines(f)[0]) for f in MECHANISMS[variant][1])


@contextlib.contextmanager
def patched(name: str) -> Iterator[None]:
    saved = []
    for module, attr, make in VARIANTS.get(name, ()):
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, make())
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def copies(hlo: str, min_elements: int) -> int:
    """Copies in `hlo` of an array of at least `min_elements` elements."""
    n = 0
    for dims in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        n += size >= min_elements
    return n


class Runner:
    """One compiled step, traced under a variant's patch, and its carry."""

    def __init__(self, variant, step, init, params, grads):
        self.params = jax.tree.map(jnp.copy, params)
        self.grads = grads
        self.state = init(self.params)
        with patched(variant):
            lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
                self.params, self.state, grads
            )
        self.compiled = lowered.compile()
        self.temp_mb = self.compiled.memory_analysis().temp_size_in_bytes / 2**20
        leaf = min(x.size for x in jax.tree.leaves(params))
        self.copies = copies(self.compiled.as_text(), leaf)
        self.times: list[float] = []
        self.call()

    def call(self) -> float:
        start = time.perf_counter()
        self.params, self.state = self.compiled(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))
        return time.perf_counter() - start


def steps(inner: str, emit: bool) -> dict[tuple[str, str], tuple[Callable, Callable]]:
    """(variant, form) -> (init, step(params, state, grads))."""
    k = 1 if emit else NEVER
    make = INNER[inner]

    def drop_in(params, state, grads, opt):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    out = {}
    for variant in VARIANTS:
        opt = optax_ext.MultiSteps(make(), k)
        out[variant, "drop-in"] = (
            opt.init,
            lambda p, s, g, opt=opt: drop_in(p, s, g, opt),
        )
        out[variant, "fused"] = (
            opt.init,
            lambda p, s, g, opt=opt: optax_ext.apply_gradients(opt, g, s, p),
        )
    init, update, apply = plain_multi_steps(make(), k)
    out["plain", "drop-in"] = (
        init,
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*update(g, s, p)),
    )
    out["plain", "fused"] = (init, lambda p, s, g: apply(g, s, p))
    return out


def bench(inner: str, layout: str, rounds: int) -> dict:
    params = make_params(layout, "float32")
    grads = jax.tree.map(lambda p: jnp.cos(p * 100).astype(p.dtype), params)
    runners = {}
    for emit in (False, True):
        for (variant, form), (init, step) in steps(inner, emit).items():
            label = f"{variant} | {form} | {'emit' if emit else 'mini'}"
            runners[label] = Runner(variant, step, init, params, grads)
    time_interleaved(list(runners.values()), rounds)
    return {
        label: {
            "ms": 1e3 * statistics.median(r.times),
            "temp_mb": r.temp_mb,
            "copies": r.copies,
        }
        for label, r in runners.items()
    }


def _summary_cell(results: dict, variant: str, layout: str) -> str:
    """Over the inner optimizers, forms and steps of one layout: the most
    temporary memory and copies that removing `variant` adds, and the range
    of its time relative to `all`."""
    extra_mb, extra_copies, ratios = 0.0, 0, []
    for case, res in results.items():
        if not case.endswith(layout):
            continue
        for form in ("drop-in", "fused"):
            for step in ("mini", "emit"):
                r = res[f"{variant} | {form} | {step}"]
                base = res[f"all | {form} | {step}"]
                extra_mb = max(extra_mb, r["temp_mb"] - base["temp_mb"])
                extra_copies = max(extra_copies, r["copies"] - base["copies"])
                ratios.append(r["ms"] / base["ms"])
    if not ratios:
        return "-"
    return (
        f"+{extra_mb:.1f} MiB, +{extra_copies} copies, "
        f"time {min(ratios):.2f} to {max(ratios):.2f}"
    )


def write_table(results: dict, path: Path, measured_on: str) -> str:
    variants = [*VARIANTS, "plain"]
    layouts = [lay for lay in LAYOUTS if any(c.endswith(lay) for c in results)]
    lines = [
        "# What each mechanism of `update_if` buys",
        "",
        "Generated by `python benchmarks/mechanisms.py`; do not edit by hand.",
        f"Machine: {measured_on}.",
        "",
        "Each variant switches one mechanism of optax_ext.MultiSteps off (see "
        "the script's docstring and `docs/design.md`); `plain` is the ~40-line "
        "`lax.cond` MultiSteps. Params and state donated, float32, medians of "
        "interleaved rounds.",
        "",
        "## Summary",
        "",
        "What removing each mechanism costs, over the inner optimizers, both "
        "forms (drop-in, fused) and both steps (mini, emit) of a layout: the "
        "most temporary memory and copies of a params-leaf-sized array it "
        "adds, and the range of step time relative to every mechanism on "
        "(above 1: slower without it). `plain`: the plain `lax.cond` "
        "MultiSteps against optax_ext.",
        "",
        "| mechanism | lines | " + " | ".join(layouts) + " |",
        "|---|---|" + "---|" * len(layouts),
    ]
    for variant in ["all again", *MECHANISMS, "plain"]:
        what = MECHANISMS.get(variant, ("", ()))[0]
        if variant == "plain":
            what = "all of them"
        elif variant == "all again":
            what = "none: every mechanism on, compiled again (the timing's noise)"
        count = str(code_lines(variant)) if variant in MECHANISMS else "-"
        cells = [_summary_cell(results, variant, lay) for lay in layouts]
        lines.append(f"| {variant}: {what} | {count} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Per case",
        "",
        "Cells: temporary MiB / copies of a params-leaf-sized array / time "
        "relative to `all` in the same form and step (`all`: ms per step).",
        "",
    ]
    for case, res in results.items():
        lines += [f"### {case}", ""]
        lines.append(
            "| variant | drop-in mini | drop-in emit | fused mini | fused emit |"
        )
        lines.append("|---|---|---|---|---|")
        for variant in variants:
            cells = []
            for form in ("drop-in", "fused"):
                for step in ("mini", "emit"):
                    r = res[f"{variant} | {form} | {step}"]
                    base = res[f"all | {form} | {step}"]
                    if variant == "all":
                        time = f"{r['ms']:.2f} ms"
                    else:
                        time = f"{r['ms'] / base['ms']:.2f}"
                    cells.append(f"{r['temp_mb']:.1f} / {r['copies']} / {time}")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", nargs="*", help="a subset of the inner optimizers")
    parser.add_argument(
        "--from-json", type=Path, help="rewrite the table of a saved run"
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(write_table(saved["cases"], RESULTS / "mechanisms.md", saved["machine"]))
        return
    if args.case:
        inner, layout, rounds = args.case
        print(json.dumps(bench(inner, layout, int(rounds))))
        return
    cases = [
        (i, lay)
        for lay in LAYOUTS
        for i in args.inner or INNER
        if i not in COMPOSED or lay != "300 x (64, 64)"
    ]
    if args.quick:
        cases = [("lion", "96 x (64, 64)")]
    results = {}
    for inner, layout in cases:
        rounds = 2 if args.quick else args.rounds
        out = subprocess.run(
            [sys.executable, __file__, "--case", inner, layout, str(rounds)],
            check=True,
            capture_output=True,
            text=True,
        )
        results[f"{inner}, {layout}"] = json.loads(out.stdout.splitlines()[-1])
        print(inner, layout, flush=True)
    if args.quick:
        print(write_table(results, Path("/dev/null"), machine()))
        return
    saved = {"machine": machine(), "cases": results}
    (RESULTS / "mechanisms.json").write_text(json.dumps(saved, indent=1))
    print(write_table(results, RESULTS / "mechanisms.md", saved["machine"]))


if __name__ == "__main__":
    main()
