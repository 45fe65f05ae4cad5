"""Small helpers shared by the tests (independent of optax_ext's code)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def avals(tree):
    """(shape, dtype, weak_type) of every leaf, with its path."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (
            jax.tree_util.keystr(path),
            tuple(jnp.shape(x)),
            str(x.dtype),
            bool(getattr(x, "weak_type", False)),
        )
        for path, x in leaves
    ]


def assert_exact_zeros(tree, like=None):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x)
        assert not np.isnan(x).any(), f"NaN at {jax.tree_util.keystr(path)}"
        assert (x == 0).all(), f"non-zero at {jax.tree_util.keystr(path)}: {x}"
    if like is not None:
        assert avals(tree) == avals(like)


def to_np(x):
    x = jnp.asarray(x)
    if x.dtype in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    return np.asarray(x)


def hlo_computations(hlo: str) -> dict[str, list[str]]:
    """Instruction lines of each computation of an HLO module, by name."""
    comps, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            name = "ENTRY" if line.startswith("ENTRY") else header.group(1)
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line.split(", metadata=")[0].strip())
    return comps


def xla_cpu_only(what: str) -> pytest.MarkDecorator:
    """Skips a test that asserts `what` of the program XLA:CPU compiles (HLO
    text, `memory_analysis()`, copies, collectives) on any other backend,
    whose compiler fuses, schedules and assigns buffers its own way."""
    backend = jax.default_backend()
    return pytest.mark.skipif(
        backend != "cpu",
        reason=f"asserts XLA:CPU's {what}; this run's backend is {backend}",
    )


_CALLEES = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)


def reachable(comps, root, avoid=()):
    """Names of the computations that `root` runs, itself included, not
    entering those in `avoid`."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name in avoid or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for single, many in _CALLEES.findall(line):
                todo.extend([single] if single else re.findall(r"%([\w.\-]+)", many))
    return seen


_COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\("
)


def collectives_by_step(hlo):
    """(collectives a mini-step runs, collectives only an emitting step
    runs): the emitting branch is the one that runs the inner optimizer,
    the second of the outermost conditional's branches in the entry
    computation."""
    comps = hlo_computations(hlo)
    (cond,) = [line for line in comps["ENTRY"] if " conditional(" in line]
    branches = re.search(r"branch_computations=\{([^}]*)\}", cond).group(1)
    _, emit = re.findall(r"%([\w.\-]+)", branches)
    mini = reachable(comps, "ENTRY", avoid={emit})
    emitting = reachable(comps, emit) - mini

    def found(names):
        lines = [line for name in sorted(names) for line in comps[name]]
        return [m.groups() for m in map(_COLLECTIVE.search, lines) if m]

    return found(mini), found(emitting)


def loop_computations(comps):
    """Names of the computations a `while` runs (its body and condition, and
    everything they call)."""
    seen, todo = set(), []
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                todo += re.findall(r"(?:body|condition)=%([\w.\-]+)", line)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
    return seen
