"""Small helpers shared by the tests (independent of optax_ext's code)."""

import os
import pathlib
import re
import subprocess
from collections.abc import Callable

import equinox as eqx
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


# -- comparing two differently compiled programs ----------------------------

# Set to force the bound below on XLA:CPU too: how the tests of the bound (and
# a test's power to fail under it) are checked without another backend.
_FORCE_BOUND = os.environ.get("OPTAX_EXT_TESTS_CROSS_PROGRAM_BOUND", "") not in (
    "",
    "0",
)


def across_programs_exact() -> bool:
    """Whether `assert_close_across_programs` asserts equality: on XLA:CPU,
    unless OPTAX_EXT_TESTS_CROSS_PROGRAM_BOUND is set."""
    return jax.default_backend() == "cpu" and not _FORCE_BOUND


def cross_program_tolerance(want, *, ops: int, magnitude=None) -> np.ndarray:
    """The elementwise bound of `assert_close_across_programs` for the leaf
    `want` (float64): `ops * eps * M + ops * smallest_normal`, with `eps` the
    spacing of `want`'s dtype at 1 and `M = magnitude`, or the largest
    finite |want| in the leaf when `magnitude` is None."""
    info = jnp.finfo(jnp.asarray(want).dtype)
    w = np.abs(to_np(want)).astype(np.float64)
    if magnitude is None:
        magnitude = w[np.isfinite(w)].max(initial=0.0)
    m = np.broadcast_to(np.asarray(magnitude, np.float64), w.shape)
    return ops * float(info.eps) * m + ops * float(info.smallest_normal)


def assert_close_across_programs(got, want, *, ops: int, magnitude=None, err_msg=""):
    """`got` and `want`, trees of the same values computed by two differently
    compiled programs (injected vs bare optimizer, MultiSteps vs the inner
    optimizer on the window's mean, `apply_gradients` vs `update` +
    `apply_updates`), are equal on XLA:CPU and within a rounding bound on
    other backends.

    Every backend: same tree structure, dtypes and shapes; integer, bool and
    key leaves equal; NaN and inf where the other has them (same signs).

    XLA:CPU: floating leaves equal (`np.testing.assert_array_equal`: NaN
    equals NaN, -0.0 equals 0.0). That is what the docs promise there, and
    what these tests hold it to.

    Other backends (XLA:GPU, XLA:TPU): finite entries within

        |got - want| <= ops * eps * M + ops * smallest_normal

    where `eps` is the dtype's spacing at 1 (2**-7 bfloat16, 2**-10 float16,
    2**-23 float32), `M` the magnitude of the values the computation combines
    (`magnitude`; by default the largest finite |want| in the leaf) and `ops`
    the number of rounding steps on the path from the common inputs to an
    entry, over every step the compared run takes. Why: let y be the exact
    (real-arithmetic) value. A program that rounds after each of its `ops`
    operations to a format at least as wide as the dtype returns y within
    `ops * u * M` to first order (standard forward error analysis; Higham,
    "Accuracy and Stability of Numerical Algorithms", ch. 2-4), u = eps / 2
    the unit roundoff, M bounding the magnitudes of the terms and
    intermediates (so cancellation is covered: the bound is relative to the
    terms, not to a small difference of them). What XLA does differently
    per program stays inside that model: fusion keeping a bfloat16/float16
    intermediate in float32 (excess precision) rounds to 2**-24 <= u
    instead of u; contracting a multiply and an add into an FMA drops a
    rounding; reassociating a sum of k terms is within (k - 1) * u of its
    terms' magnitude whatever the order, so a k-term sum or a length-k dot
    counts k - 1 (resp. k) rounding steps. Both programs being within
    `ops * u * M` of y, they are within `2 * ops * u * M = ops * eps * M` of
    each other. `ops * smallest_normal` covers subnormals flushed to zero
    (XLA:GPU's default), each flush an absolute error below the smallest
    normal. The bound is first order: it means something while
    `ops * eps` is well below 1, and for long half-precision runs it is loose
    by design; bit identity is tested on XLA:CPU.
    """
    assert jax.tree.structure(got) == jax.tree.structure(want), err_msg
    exact = across_programs_exact()
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        where = f"{err_msg} at {jax.tree_util.keystr(path)}".strip()
        g, w = jnp.asarray(g), jnp.asarray(w)
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype}, want {w.dtype}"
        assert g.shape == w.shape, f"{where}: shape {g.shape}, want {w.shape}"
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        if exact or not jnp.issubdtype(w.dtype, jnp.inexact):
            np.testing.assert_array_equal(to_np(g), to_np(w), err_msg=where)
            continue
        gx, wx = to_np(g), to_np(w)
        finite = np.isfinite(wx)
        np.testing.assert_array_equal(gx[~finite], wx[~finite], err_msg=where)
        assert np.isfinite(gx[finite]).all(), f"{where}: non-finite entries\n{gx}"
        err = np.abs(gx.astype(np.complex128) - wx.astype(np.complex128))[finite]
        tol = cross_program_tolerance(w, ops=ops, magnitude=magnitude)[finite]
        assert (err <= tol).all(), (
            f"{where}: differs by up to {np.max(err / tol, initial=0):.3g} times "
            f"the bound of {ops} rounding steps of {w.dtype}\ngot  {gx}\nwant {wx}"
        )


F32_EPS = float(np.finfo(np.float32).eps)
# XLA:CPU at -O0 (the suite's default, conftest.py) compiles without LLVM's
# optimisations, which contract and reorder float arithmetic: there two
# programs doing the same operations give the same bits. At XLA's default
# level they differ by an ulp or so.
SAME_BITS = jax.default_backend() == "cpu" and (
    "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
)


def assert_float32_close(got, want, ulps=4):
    """Leaf by leaf within `ulps` float32 roundings of the leaf's scale: two
    programs (or a float64 reference) that fuse the same arithmetic apart."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=0, atol=ulps * F32_EPS * scale)


def assert_same_arithmetic(got, want):
    """Two programs doing the same float32 operations: bit for bit where
    `SAME_BITS`, within float32 rounding elsewhere."""
    assert_float32_close(got, want)
    if SAME_BITS:
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version

    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version("jaxlib"))
    return tuple(int(x) for x in found.groups())


def cpu_before_jaxlib_0_11() -> bool:
    """Whether XLA:CPU is that of a jaxlib below 0.11, whose fusion undoes
    orders the package writes (Lion's moment after its updates)."""
    return jaxlib_version() < (0, 11)


# From this jaxlib on, XLA:CPU keeps the fused step's buffers in place.
CPU_MEMORY_FROM = (0, 10, 2)


def skip_cpu_memory_before_0_10_2(backend: str = "cpu") -> None:
    """Skips an assertion of XLA:CPU's compiled temporary memory (and of
    the host-chosen emitting step's copies) below jaxlib 0.10.2, for which
    the package states none: there XLA:CPU keeps
    a params-sized temporary more for the fused Adam step (1.0x the params
    with jaxlib 0.8.1, 0.9.2 and 0.10.0, where 0.10.2 needs none), in
    either form of the window; the values are the same (docs/design.md,
    "When JAX or XLA changes")."""
    if backend == "cpu" and jaxlib_version() < CPU_MEMORY_FROM:
        pytest.skip(
            "XLA:CPU's temporary memory is stated from jaxlib 0.10.2; this is "
            + ".".join(map(str, jaxlib_version()))
        )


def child_pytest(python, args, env, what: str) -> str:
    """Runs `python -m pytest -q *args` from the repository root with `env`
    and returns its summary line; fails, with its output, unless it passed."""
    root = pathlib.Path(__file__).parent.parent
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = (result.stdout.strip().splitlines()[-1:] or ["(no output)"])[0]
    assert result.returncode == 0, (
        f"{what} failed ({summary}):\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
    )
    return summary


class ModelWithPythonLeaves(eqx.Module):
    """A tiny Equinox model whose leaves are not all arrays: an
    `eqx.nn.Dropout` (a Python float `p`, a bool `inference`), an activation
    function and a Python int. `eqx.filter_grad` gives each of them a `None`
    gradient."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    activation: Callable
    scale: int

    def __call__(self, x):
        return self.activation(self.linear(x)) * self.scale


def model_with_python_leaves() -> ModelWithPythonLeaves:
    return ModelWithPythonLeaves(
        eqx.nn.Linear(3, 2, key=jax.random.key(0)),
        eqx.nn.Dropout(0.25),
        jax.nn.relu,
        3,
    )


def model_grads(model, i: int):
    """`eqx.filter_grad` of a squared-output loss on the `i`-th batch."""
    x = jnp.cos(jnp.arange(6.0).reshape(2, 3) + i)
    return eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)


def assert_python_leaves_kept(new, model) -> None:
    """`new`'s leaves that are not arrays are `model`'s, as they were."""
    assert new.dropout.p == model.dropout.p and type(new.dropout.p) is float
    assert new.dropout.inference is model.dropout.inference
    assert new.activation is model.activation
    assert new.scale == model.scale and type(new.scale) is int
