"""Your train step's device time per window, estimated from its compile for
an H200 and a TPU v5e, without either device: the public entry point of
the estimate `benchmarks/whole_step.py --estimate` prints.

    from benchmarks import step_cost

    cost = step_cost.estimate(fused_step(opt), params, state, batch, target="H200")
    print(cost.cost, cost.kernels, cost.launch_cost, cost.with_launches)

`estimate` compiles the step (params and state donated) and costs it;
`window_cost` costs a program you compiled already (a `jax.jit(...)
.lower(...).compile()` or its `as_text()`); `table` prints several forms
side by side. From the command line, on programs saved with
`open(FILE, "w").write(compiled.as_text())`:

    python -m benchmarks.step_cost --target H200 optax=optax.hlo \
        fused=fused.hlo emit==emit_false.hlo,emit_true.hlo

Run from the repository root (or with `optax_ext` installed editable,
which puts the root on `sys.path`), in the deviceless environment of
`docs/check_your_step.md` for `estimate` and `compile_for`. An estimate,
not a measurement:

- H200: each kernel of the entry computation (and of the branch a step
  runs) takes max(FLOPs / peak, bytes / 4.8 TB/s). Bytes are its
  operands' and result's, as `bytes_model.py` of the project's GPU notes
  counts them; FLOPs are 2 x the output's elements x the contracted size
  of each `dot` it runs. Peaks: the H200's dense tensor-core figures,
  494.7 TFLOP/s for a float32 dot (JAX's default precision runs it in
  TF32 on this GPU), 989.4 TFLOP/s for bfloat16, 66.9 TFLOP/s for any
  other. Every kernel at its peak, one after another: without launches,
  a lower bound that favours no form.
- Launches (H200): every instruction that is not free (a fusion, a
  cuBLAS call, a copy) launches one kernel, and a conditional one more
  (its predicate read): for the steps of `docs/check_your_step.md`, the
  thunks of XLA's `thunk_sequence_after_thunk_passes` dump. `launch_us`
  per launch, `LAUNCH_US` = 1 us by default: the figure XLA:GPU's own
  cost model charges per kernel when it decides what to fuse
  (`kKernelLaunchOverhead`, `xla/service/gpu/model/
  gpu_performance_model_base.h` in openxla/xla). The term is added to the
  kernels' time (no overlap). With its driver version in the target, jax
  0.11.2 plans those steps as one CUDA graph each
  (`XLA_FLAGS=--xla_dump_to=DIR`: one command buffer in the
  `thunk_sequence_after_thunk_passes.txt`), which does the host's launch
  work once for all its kernels (NVIDIA's CUDA Programming Guide, "CUDA
  Graphs"); launched one by one (CUDA graphs off, as under a profiler),
  each costs more. Your own figure: (the measured step - the estimate
  without launches) / the kernels, passed as `launch_us`. Launches add
  about as much to every form, so they pull each ratio between forms
  toward the ratio of their kernel counts, near 1: much on a small
  model, where launches dominate, little on a large one.
- TPU v5e: the sum of the `estimated_cycles` XLA:TPU's cost model writes
  on each instruction of the entry computation (and of the branch a step
  runs). Instructions without it (asynchronous copies and slices, scalar
  ops, a gather and a scatter) count 0 (`uncosted`). The program runs on
  the chip as one: no launch term.
- A window of `window` steps is `window` - 1 mini-steps and 1 emitting
  step. A two-branch conditional costs its cheaper branch on a mini-step
  and its dearer one on the emitting step; a loop's body counts as many
  times as the loop runs (`microbatched`'s loop over its micro-batches):
  XLA's `known_trip_count`, else a `counter < N` condition on a counter
  starting from a constant, else once; its condition is not counted. A
  program that runs a whole window itself (`microbatched`): `window=1`.
  Where the host chooses (`apply_gradients(..., emit=)`), pass the
  `emit=False` program as the step and the `emit=True` one as `emitting`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

__all__ = [
    "LAUNCH_US",
    "ProgramCost",
    "StepCost",
    "compile_for",
    "estimate",
    "program_cost",
    "table",
    "window_cost",
]

# One kernel launch on the H200, in microseconds (the docstring says why).
LAUNCH_US = 1.0
H200_TARGET = (
    pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "h200_target.txtpb"
)
# The names a target goes by: the public one, and whole_step.py's backend.
TARGETS = {"H200": "gpu", "gpu": "gpu", "TPU v5e": "tpu", "tpu": "tpu"}

H200_BYTES_PER_S = 4.8e12
# The H200's dense peaks: tensor cores for float32 dots at JAX's default
# precision (TF32) and for bfloat16 ones; CUDA cores otherwise.
H200_PEAK = {"f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12}
H200_OTHER_PEAK = 66.9e12
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
DTYPE_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8}
DTYPE_BYTES |= {"f64": 8}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
# Ops that launch no kernel and move no data of their own.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
FREE |= {"after-all", "opt-barrier", "partition-id", "replica-id"}
FREE |= {"copy-start", "copy-done", "add-dependency"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)$")


class ProgramCost(NamedTuple):
    """One run of a compiled program."""

    cost: float  # seconds on the H200 (no launches); cycles on the TPU v5e
    flops: int  # of the dots its H200 kernels run (0 on the TPU v5e)
    bytes: int  # its H200 kernels read and write (0 on the TPU v5e)
    uncosted: int  # TPU v5e: instructions without `estimated_cycles`, all branches
    kernels: int  # kernels it launches, a conditional's predicate read included


def _backend(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: expected 'H200' or 'TPU v5e'")
    return TARGETS[target]


def _arrays(shape_text):
    """[(dtype, [dims])] of the arrays in an HLO shape."""
    return [
        (dtype, [int(d) for d in dims.split(",") if d])
        for dtype, dims in ARRAY.findall(shape_text)
    ]


def _bytes_of(shape_text):
    total = 0
    for dtype, dims in _arrays(shape_text):
        n = DTYPE_BYTES[dtype]
        for d in dims:
            n *= d
        total += n
    return total


def _module(text):
    """({computation: its instruction lines}, the entry's name, {name: shape})."""
    comps, name, entry, shapes = {}, None, None, {}
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
            found = INSTRUCTION.match(line)
            if found:
                shapes[found.group(1)] = found.group(2)
    return comps, entry, shapes


def _dot_flops(comps, shapes, name, seen=None):
    """FLOPs and the lhs dtype of every dot a computation runs, nested
    computations included: [(flops, dtype)]."""
    seen = set() if seen is None else seen
    found = []
    for line in comps.get(name, []):
        m = INSTRUCTION.match(line)
        if not m:
            continue
        _, out, op, rest = m.groups()
        if op == "dot" or (op == "custom-call" and "__cublas" in rest):
            lhs = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
            (lhs_dtype, lhs_dims), *_ = _arrays(shapes.get(lhs, "")) or [("f32", [])]
            if op == "dot":
                dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
                contracting = [int(d) for d in dims.split(",") if d]
            else:
                dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
                contracting = [int(d.strip('" ')) for d in dims.group(1).split(",")]
            k = 1
            for d in contracting:
                k *= lhs_dims[d]
            out_elements = 1
            for d in _arrays(out)[0][1]:
                out_elements *= d
            found.append((2 * out_elements * k, lhs_dtype))
        for called in re.findall(r"calls=%?([\w.\-]+)", rest):
            if called not in seen:
                seen.add(called)
                found += _dot_flops(comps, shapes, called, seen)
    return found


def _gpu_kernel(comps, shapes, line, out, op, rest):
    """(seconds, FLOPs, bytes) of one H200 kernel."""
    operands = rest.split("), ")[0] if "), " in rest else rest
    moved = _bytes_of(out) + sum(
        _bytes_of(shapes.get(r, "")) for r in re.findall(r"%([\w.\-]+)", operands)
    )
    flops = [
        f
        for called in re.findall(r"calls=%?([\w.\-]+)", rest)
        for f in _dot_flops(comps, shapes, called)
    ]
    if op == "custom-call":
        flops += _dot_flops({"one": [line]}, shapes, "one")
    compute = sum(f / H200_PEAK.get(dtype, H200_OTHER_PEAK) for f, dtype in flops)
    return max(compute, moved / H200_BYTES_PER_S), sum(f for f, _ in flops), moved


def _trip_count(comps, rest) -> int:
    """The times a `while` (its text after `while(`) runs its body: XLA's
    `known_trip_count` (XLA:CPU and XLA:GPU write it), else read from the
    loop (XLA:TPU does not): a condition `counter < constant N` on a tuple
    element whose initial value is a constant S, stepping by 1, runs N - S
    times. 1 where neither says."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if known:
        return int(known.group(1))
    lines = {}
    for body in comps.values():
        for line in body:
            found = INSTRUCTION.match(line)
            if found:
                lines[found.group(1)] = line
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    root = [x for x in comps.get(cond.group(1) if cond else "", []) if "ROOT" in x]
    test = re.search(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=LT", *root[:1])
    if not test:
        return 1

    def constant(name):
        line = lines.get(name, "")  # through copies to a constant
        while re.search(r"= \S+ copy\(", line):
            line = lines.get(re.search(r"copy\(%?([\w.\-]+)\)", line).group(1), "")
        found = re.search(r"= \S+ constant\((-?\d+)\)", line)
        return int(found.group(1)) if found else None

    index = re.search(r"get-tuple-element\(.*index=(\d+)", lines.get(test.group(1), ""))
    end = constant(test.group(2))
    init = re.match(r"%?([\w.\-]+)\)", rest)
    tuple_line = lines.get(init.group(1), "") if init else ""
    operands = re.search(r"tuple\((.*?)\)(?:,|$)", tuple_line)
    if not (index and end is not None and operands):
        return 1
    names = re.sub(r"/\*index=\d+\*/", "", operands.group(1)).split(",")
    i = int(index.group(1))
    start = constant(names[i].strip().lstrip("%")) if i < len(names) else None
    return end - start if start is not None and end > start else 1


def _tpu_kernel(line):
    found = re.search(r'"estimated_cycles":"(\d+)"', line)
    return (int(found.group(1)), 0, 0) if found else None


def _text(program) -> str:
    return program if isinstance(program, str) else program.as_text()


def program_cost(program, target: str, pick: Callable = min) -> ProgramCost:
    """One run of a compiled program on `target` ("H200" or "TPU v5e").

    **Arguments:**

    - `program`: a compiled step (`jax.jit(f).lower(...).compile()`, for
      that target) or its `as_text()`.
    - `pick`: chooses among a conditional's branches' costs: `min` (a
      mini-step runs the cheaper branch) or `max` (an emitting step the
      dearer one).

    **Returns:** a `ProgramCost`: seconds on the H200 (kernels at their
    peaks, no launches) or cycles on the TPU v5e, and the kernels launched.
    """
    backend = _backend(target)
    comps, entry, shapes = _module(_text(program))
    missing = [0]

    def run(name):
        total = [0.0, 0, 0, 0]  # cost, FLOPs, bytes, kernels
        for line in comps[name]:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            _, out, op, rest = m.groups()
            if op in FREE:
                continue
            if op == "conditional":
                found = re.findall(r"branch_computations=\{([^}]*)\}", rest)
                names = re.findall(r"%?([\w.\-]+)", found[0]) if found else []
                names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)
                costs = [run(n) for n in names]
                chosen = pick(costs, key=lambda c: c[0])
                total = [a + b for a, b in zip(total, chosen, strict=True)]
                total[3] += 1  # the predicate, read before the branch runs
                continue
            if op in ("while", "call"):
                body = re.search(r"(?:body|to_apply)=%?([\w.\-]+)", rest)
                times = _trip_count(comps, rest) if op == "while" else 1
                if body:
                    total = [
                        a + b * times
                        for a, b in zip(total, run(body.group(1)), strict=True)
                    ]
                continue
            if backend == "gpu":
                cost = _gpu_kernel(comps, shapes, line, out, op, rest)
            else:
                cost = _tpu_kernel(line)
                if cost is None:
                    missing[0] += 1
                    cost = (0, 0, 0)
            total = [a + b for a, b in zip(total, (*cost, 1), strict=True)]
        return total

    cost, flops, moved, kernels = run(entry)
    return ProgramCost(cost, flops, moved, missing[0], kernels)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A window of one form of a train step on one target: `window` - 1
    mini-steps and the emitting step that ends it."""

    target: str  # "H200" or "TPU v5e"
    window: int
    mini: ProgramCost  # a mini-step: each conditional's cheaper branch
    emitting: ProgramCost  # the window's last step: the dearer branch
    temp: tuple[int | None, int | None]  # temporary bytes: mini, emitting
    launch_us: float = LAUNCH_US

    @property
    def cost(self) -> float:
        """The window without launches: seconds (H200) or cycles (v5e)."""
        return sum(p.cost for p in [self.mini] * (self.window - 1) + [self.emitting])

    @property
    def kernels(self) -> int:
        """The kernels the window launches."""
        return (self.window - 1) * self.mini.kernels + self.emitting.kernels

    @property
    def launch_cost(self) -> float:
        """Seconds of the window's launches on the H200: `kernels` x
        `launch_us`. 0 on the TPU v5e, whose program runs as one."""
        return self.kernels * self.launch_us * 1e-6 if self.target == "H200" else 0.0

    @property
    def with_launches(self) -> float:
        return self.cost + self.launch_cost


def _temp(program) -> int | None:
    if isinstance(program, str):
        return None
    return program.memory_analysis().temp_size_in_bytes


def window_cost(
    program, target: str, *, window: int = 4, emitting=None, launch_us=LAUNCH_US
) -> StepCost:
    """A window of a compiled step on `target` ("H200" or "TPU v5e").

    **Arguments:**

    - `program`: the step every step of the window runs, compiled for
      `target` (or its `as_text()`); where the host chooses the step (the
      `emit=` form), the mini-step's program (`emit=False`).
    - `window`: the steps in a window (`every_k_schedule`).
    - `emitting`: the program of the step that ends the window, when it
      is another one (`emit=True`); else `program`'s dearer branches.
    - `launch_us`: microseconds per kernel launch on the H200.

    **Returns:** a `StepCost`.
    """
    if window < 1:
        raise ValueError(f"window {window}: expected 1 or more steps")
    last = program if emitting is None else emitting
    name = {"gpu": "H200", "tpu": "TPU v5e"}[_backend(target)]
    return StepCost(
        name,
        window,
        program_cost(program, target, min),
        program_cost(last, target, max),
        (_temp(program), _temp(last)),
        launch_us,
    )


def compile_for(target: str, step: Callable, *args, donate_argnums=(0, 1)):
    """`jax.jit(step, donate_argnums=donate_argnums)` compiled for one
    device of `target` ("H200" or "TPU v5e"), deviceless, with arguments
    shaped like `args` (arrays or `jax.ShapeDtypeStruct`s). Needs the
    deviceless environment and `JAX_PLATFORMS=cpu` (set here if JAX is
    not imported yet)."""
    import os
    import sys

    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    if _backend(target) == "gpu":
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H200_TARGET.read_text(), topology="1x1x1"
        )
    else:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=(1, 1, 1)
        )
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())

    def shaped(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    jitted = jax.jit(step, donate_argnums=donate_argnums)
    return jitted.lower(*map(shaped, args)).compile()


def estimate(
    step: Callable,
    *args,
    target: str = "H200",
    window: int = 4,
    emitting_step: Callable | None = None,
    launch_us: float = LAUNCH_US,
) -> StepCost:
    """Compile `step(*args)` for `target` (params and state, its first two
    arguments, donated) and estimate a window of it: `window_cost` of
    `compile_for(target, step, *args)`. Pass the `emit=True` step as
    `emitting_step` where the host chooses (`step`: the `emit=False` one).
    """
    program = compile_for(target, step, *args)
    last = None if emitting_step is None else compile_for(target, emitting_step, *args)
    return window_cost(
        program, target, window=window, emitting=last, launch_us=launch_us
    )


def _memory(temp, params_bytes):
    if temp is None:
        return "-"
    return f"{temp / params_bytes:.3f}" if params_bytes else f"{temp / 1e6:.1f}"


def table(
    costs: Mapping[str, StepCost], baseline: str | None = None, params_bytes=None
) -> str:
    """A Markdown table of `costs` (form name: its `StepCost`; one target
    and one window for all). Per form: on the H200 the kernels a mini-step
    and the emitting step launch, the window's time without and with its
    launches; on the TPU v5e the window's cycles; `baseline`'s figure over
    the form's (above 1: the form is faster; the first form by default);
    the temporary memory of its programs, over `params_bytes` if given."""
    if len({(c.target, c.window) for c in costs.values()}) != 1:
        raise ValueError("table: give forms of one target and one window")
    baseline = baseline or next(iter(costs))
    base = costs[baseline]
    gpu = base.target == "H200"
    unit, scale = ("us", 1e6) if gpu else ("k cycles", 1e-3)
    head = ["form", f"window of {base.window}, {unit}", f"{baseline} / form"]
    if gpu:
        head[1:1] = ["kernels: mini-step, emitting"]
        head[3:3] = ["launches, us", "with launches, us"]
        head += ["with launches"]
    head += ["temp / params" if params_bytes else "temp, MB"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, c in costs.items():
        row = [name, f"{c.cost * scale:.1f}", f"{base.cost / c.cost:.2f}"]
        if gpu:
            row[1:1] = [f"{c.mini.kernels}, {c.emitting.kernels}"]
            row[3:3] = [f"{c.launch_cost * 1e6:.1f}", f"{c.with_launches * 1e6:.1f}"]
            row += [f"{base.with_launches / c.with_launches:.2f}"]
        row += [", ".join(_memory(t, params_bytes) for t in dict.fromkeys(c.temp))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_cost",
        description="Estimate a window of each form of a train step from "
        "its compiled program, saved with compiled.as_text().",
    )
    parser.add_argument("forms", nargs="+", metavar="NAME=FILE[,EMITTING_FILE]")
    parser.add_argument("--target", choices=["H200", "TPU v5e"], default="H200")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--launch-us", type=float, default=LAUNCH_US)
    parser.add_argument("--baseline", help="the form the ratios divide (the first)")
    args = parser.parse_args(argv)
    costs = {}
    for spec in args.forms:
        name, _, files = spec.rpartition("=")
        first, _, last = files.partition(",")
        costs[name] = window_cost(
            pathlib.Path(first).read_text(),
            args.target,
            window=args.window,
            emitting=pathlib.Path(last).read_text() if last else None,
            launch_us=args.launch_us,
        )
    print(table(costs, args.baseline))


if __name__ == "__main__":
    main()
