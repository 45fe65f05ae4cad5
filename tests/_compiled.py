"""Compiling a train step for XLA:CPU, for an H200 (XLA:GPU) and for a TPU
v5e (XLA:TPU) on a machine with neither ("deviceless": JAX's CUDA plugin
and libtpu compile for a target they describe), and reading what each will
run: conditionals, where the optimizer's ops are, copies, memory.

The GPU and TPU compiles need jax 0.11.2 with `jax-cuda13-plugin` and
`libtpu` (`.ci/run` builds that environment, README "Running the tests").
Independent of optax_ext's code."""

from __future__ import annotations

import os
import pathlib
import re
from importlib.metadata import PackageNotFoundError, version

# Deviceless: the CUDA plugin registers only without a GPU platform asked
# for (a script importing this first; the tests' conftest sets it too).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a lock file per machine unless told that several processes
# (pytest -n) may load it; no process here owns a TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
from _helpers import hlo_computations, reachable  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

# The versions the GPU machines run; another XLA assigns buffers otherwise.
PINNED_JAX = "0.11.2"
TARGET = pathlib.Path(__file__).parent / "data" / "h200_target.txtpb"
# `required` (set by `.ci/run`): `test_deviceless_runner.py` must find the
# deviceless environment. `here` (set by that runner and by `nox -s
# deviceless` in the environment itself): a compiler missing here fails.
REQUIRED = os.environ.get("OPTAX_EXT_DEVICELESS") == "required"
HERE = os.environ.get("OPTAX_EXT_DEVICELESS") == "here"


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


# How to get the environment these compiles need, and run them there.
HOW_TO_RUN = (
    "build it with `python3.12 -m venv .venv-deviceless && "
    ".venv-deviceless/bin/pip install -r tests/data/deviceless-requirements.txt "
    "-e .`, then run `.venv-deviceless/bin/python -m pytest "
    "tests/test_compiled_backends.py tests/test_train_step_memory.py`"
)


def unavailable(backend: str) -> str | None:
    """Why `backend` cannot be compiled for here, and how to run it where
    it can; `None` if it can."""
    if backend == "cpu":
        return None
    if jax.__version__ != PINNED_JAX:
        return (
            f"deviceless compiles are pinned to jax {PINNED_JAX}, not "
            f"{jax.__version__}: {HOW_TO_RUN}"
        )
    package = "jax-cuda13-plugin" if backend == "gpu" else "libtpu"
    if _installed(package) is None:
        return f"{package} is not installed: {HOW_TO_RUN}"
    return None


_MESHES: dict[str, jax.sharding.Mesh] = {}


def mesh(backend: str, devices: int = 1) -> jax.sharding.Mesh:
    """A mesh of `devices` of an H200 (`gpu`) or a TPU v5e (`tpu`) target."""
    from jax.experimental import topologies

    key = f"{backend}{devices}"
    if key not in _MESHES:
        if backend == "gpu":
            topo = topologies.get_topology_desc(
                platform="cuda",
                target_config=TARGET.read_text(),
                topology=f"1x1x{devices}",
            )
        else:
            shape = {1: "1x1", 4: "2x2", 8: "2x4"}[devices]
            extra = {"chips_per_host_bounds": (1, 1, 1)} if devices == 1 else {}
            topo = topologies.get_topology_desc(
                platform="tpu", topology_name=f"v5e:{shape}", **extra
            )
        _MESHES[key] = topologies.make_mesh(topo, (devices,), ("x",))
    return _MESHES[key]


def compile_step(backend, step, *args, donate=(0, 1)):
    """`jax.jit(step, donate_argnums=donate)` compiled for `backend`, with
    arguments shaped like `args` (on one device)."""
    sharding = None
    if backend != "cpu":
        sharding = NamedSharding(mesh(backend), PartitionSpec())

    def shaped(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    lowered = jax.jit(step, donate_argnums=donate).lower(*map(shaped, args))
    return lowered.compile()


def branch_names(comps: dict[str, list[str]]) -> set[str]:
    """Computations that only a conditional's branches run."""
    names = set()
    for lines in comps.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            found = re.search(r"branch_computations=\{([^}]*)\}", line)
            if found:
                names |= set(re.findall(r"%([\w.\-]+)", found.group(1)))
            names |= set(re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line))
    inside = set()
    for name in names:
        inside |= reachable(comps, name)
    return inside


def opcode(line: str) -> str:
    """The opcode of an HLO instruction line."""
    rhs = re.sub(r"/\*.*?\*/", "", line.split(" = ", 1)[1])
    return re.match(r"(?:\([^=]*\)|\S+) ([\w\-]+)\(", rhs).group(1)


def _moves_a_leaf(line: str, leaf_shapes: set[str]) -> bool:
    """Whether a copy writes an array of a params leaf's shape to another
    buffer of the same memory and layout: not XLA:TPU's moves into or out
    of on-chip memory (`S(1)`, memory space 1) or between tiled layouts,
    which are how it feeds its cores, not a second copy of the params."""
    found = re.match(r"\S+ = \w+(\[[\d,]*\])(\{[^}]*\})?", line)
    if not found or found.group(1) not in leaf_shapes:
        return False
    if '"memory_space":"1"' in line:  # XLA:TPU: out of on-chip memory
        return False
    layout = found.group(2) or ""
    rank = found.group(1).count(",") + 1 if found.group(1) != "[]" else 0
    default = ",".join(str(d) for d in reversed(range(rank)))
    return "S(" not in layout and (not layout or layout[1:].startswith(default))


def report(compiled, leaf_shapes: set[str], markers: tuple[str, ...]) -> dict:
    """What the compiled program runs: its conditionals, the optimizer's
    `markers` ops (`sqrt`, `sign`, ...) outside and inside conditional
    branches, the copies of an array of a params leaf's shape (`[64,256]`,
    any dtype) outside them (every step) and inside (emitting steps), and
    the memory analysis."""
    comps = hlo_computations(compiled.as_text())
    inside = branch_names(comps)
    outside = reachable(comps, "ENTRY", avoid=inside)
    counts = {"outside": 0, "inside": 0}
    copies: dict[str, list[str]] = {"outside": [], "inside": []}
    conditionals = 0
    for name, lines in comps.items():
        where = "inside" if name in inside else "outside" if name in outside else None
        for line in lines:
            if " = " not in line:
                continue
            op = opcode(line)
            conditionals += op == "conditional"
            if where and op in markers:
                counts[where] += 1
            if (
                where
                and op in ("copy", "copy-start")
                and _moves_a_leaf(line, leaf_shapes)
            ):
                copies[where].append(line[:160])
    memory = compiled.memory_analysis()
    return {
        "conditionals": conditionals,
        "markers_outside": counts["outside"],
        "markers_inside": counts["inside"],
        "copies": copies["outside"],
        "branch_copies": copies["inside"],
        "temp": memory.temp_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
    }


# What a compiled step costs a device, per backend: the cycles XLA:TPU's
# cost model estimates for each instruction (`"estimated_cycles"` in its
# backend config), or, elsewhere, the bytes each kernel reads and writes
# (an optimizer step is memory-bound: the GPU notes' `bytes_model.py`,
# outside this repository, checked against an H200's timings).
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant",
    "after-all", "opt-barrier", "partition-id", "replica-id", "copy-start",
    "copy-done", "add-dependency",
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)$")


def _array_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def step_cost(compiled, backend: str) -> tuple[int, int]:
    """(a mini-step's, an emitting step's) device cost of a compiled step:
    on a TPU (`backend == "tpu"`) XLA:TPU's estimated cycles, summed over
    the instructions run; elsewhere the bytes the kernels read and write. A
    conditional costs its cheaper branch on a mini-step and its dearer one
    on an emitting step; a loop's body is counted once."""
    text = compiled.as_text()
    comps: dict[str, list[str]] = {}
    shapes: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            name = "ENTRY" if line.startswith("ENTRY") else header.group(1)
            comps[name] = []
            for arg, shape in re.findall(
                r"([\w.\-]+): ((?:\([^)]*\))|(?:\w+\[[\d,]*\]))", line.split("->")[0]
            ):
                shapes[arg] = shape
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
            found = _INSTRUCTION.match(line)
            if found:
                shapes[found.group(1)] = found.group(2)

    def cost(comp: str, pick) -> int:
        total = 0
        for line in comps[comp]:
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            _, out, op, rest = found.groups()
            if op == "conditional":
                many = re.search(r"branch_computations=\{([^}]*)\}", rest)
                branches = (
                    re.findall(r"%([\w.\-]+)", many.group(1))
                    if many
                    else re.findall(r"(?:true|false)_computation=%([\w.\-]+)", rest)
                )
                total += pick(cost(b, pick) for b in branches)
            elif op in ("while", "call"):
                body = re.search(r"(?:body|to_apply)=%([\w.\-]+)", rest)
                total += cost(body.group(1), pick) if body else 0
            elif backend == "tpu":
                total += sum(map(int, _CYCLES.findall(line)))
            elif op not in _FREE:
                operands = rest.split("), ")[0]
                total += _array_bytes(out) + sum(
                    _array_bytes(shapes.get(r, ""))
                    for r in re.findall(r"%([\w.\-]+)", operands)
                )
        return total

    return cost("ENTRY", min), cost("ENTRY", max)


def pytest_collection_modifyitems(config, items):
    """As a pytest plugin (`-p _compiled`, tests/ on `PYTHONPATH`: the
    deviceless and newest-JAX runners' children, `nox -s deviceless`):
    under `--dist loadgroup`, each test marked `xdist_group` gets its
    group after an `@` in its nodeid, which is how pytest-xdist's
    scheduler sends a group to one worker. pytest-xdist 3.8 writes it to
    `item._nodeid`, which pytest 9.2 no longer reads (the nodeid is
    `item._id`): without this every case's reference programs compile
    once in each worker."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        grouped = item.nodeid.rfind("@") > item.nodeid.rfind("]")  # (xdist's test)
        if names and hasattr(item, "_id") and not grouped:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")
