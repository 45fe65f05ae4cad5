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
