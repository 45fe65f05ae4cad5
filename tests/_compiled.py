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
