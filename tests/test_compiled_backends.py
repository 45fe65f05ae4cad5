"""What XLA:CPU, XLA:GPU (an H200) and XLA:TPU (a v5e) compile for the
train steps users write, params and state donated: the drop-in
(`update` + `optax.apply_updates`), the fused `apply_gradients`, and the
fused step whose window the host chooses (`emit=`). Exact, so asserted,
each for the backend it names.

The GPU and TPU programs are compiled here without either ("deviceless",
`tests/_compiled.py`); these tests skip where that compiler is missing,
except under `.ci/run`, which builds it and makes a missing one fail.
On XLA:GPU and XLA:TPU, for every inner optimizer, layout and dtype here:

- a mini-step runs no op of the inner optimizer: they are all inside a
  conditional branch (XLA:GPU turns a conditional of cheap ops into
  selects, running Adam on every step, unless something keeps it);
- no array of a params leaf's shape is copied, on any step;
- the fused step needs at most the bare inner optimizer's train step's
  temporary memory plus 2% of the params' bytes (XLA:TPU, with a chain
  that reduces over the updates: plus 1.0x); the drop-in one at most that
  plus the zero updates it returns (1.0x the params);
- every donated buffer is handed back (aliased).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from _compiled import REQUIRED, compile_step, report, unavailable

import optax_ext

BACKENDS = ["cpu", "gpu", "tpu"]
K = 4


def _gpt2_like(dtype, d=64, vocab=512, context=128, layers=12):
    """GPT-2 small's tree (148 leaves), narrower: embeddings, 12 blocks of
    attention and MLP weights, biases and layer norms, a final layer norm."""
    tree = {"wte": (vocab, d), "wpe": (context, d), "ln_f.g": (d,), "ln_f.b": (d,)}
    for i in range(layers):
        for name, shape in {
            "ln_1.g": (d,),
            "ln_1.b": (d,),
            "attn.c_attn.w": (d, 3 * d),
            "attn.c_attn.b": (3 * d,),
            "attn.c_proj.w": (d, d),
            "attn.c_proj.b": (d,),
            "ln_2.g": (d,),
            "ln_2.b": (d,),
            "mlp.c_fc.w": (d, 4 * d),
            "mlp.c_fc.b": (4 * d,),
            "mlp.c_proj.w": (4 * d, d),
            "mlp.c_proj.b": (d,),
        }.items():
            tree[f"h{i:02d}.{name}"] = shape
    return {k: jnp.zeros(s, dtype) for k, s in tree.items()}


LAYOUTS = {
    "gpt2-like": _gpt2_like,
    "4 large": lambda dtype: {f"w{i}": jnp.zeros((1024, 1024), dtype) for i in range(4)},
}
_MASK = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
# name: (inner optimizer, ops only it runs, whether it reduces over the updates)
INNER = {
    "adamw": (lambda: optax.adamw(1e-3), ("sqrt",), False),
    "lion": (lambda: optax.lion(1e-4), ("sign",), False),
    "clip+adamw": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        ("sqrt",),
        True,
    ),
    "inject(adamw, mask)": (
        lambda: optax_ext.inject_hyperparams(optax.adamw)(
            learning_rate=optax.linear_schedule(0.0, 1e-3, 10), mask=_MASK
        ),
        ("sqrt",),
        False,
    ),
    "zero_nans+adamw": (
        lambda: optax.chain(optax_ext.zero_nans(), optax.adamw(1e-3)),
        ("sqrt",),
        False,
    ),
    "skip_when(adamw)": (
        lambda: optax_ext.skip_when(optax.adamw(1e-3)),
        ("sqrt",),
        False,
    ),
    "MultiSteps(adamw, 2)": (
        lambda: optax_ext.MultiSteps(optax.adamw(1e-3), 2),
        ("sqrt",),
        False,
    ),
}
# The whole matrix on the large leaves; the GPT-2-like tree (slower to
# compile) with the optimizers that differ most.
CASES = [
    (layout, inner, dtype)
    for layout in LAYOUTS
    for inner in INNER
    for dtype in ("float32", "bfloat16")
    if layout == "4 large" or inner in ("adamw", "lion", "clip+adamw")
]


def _skip_unless(backend):
    why = unavailable(backend)
    if why is None:
        return
    if REQUIRED:
        pytest.fail(f"the {backend} compile checks must run here: {why}")
    pytest.skip(why)


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _step(opt, form, weighted=False):
    extra = {"weight": jnp.float32(3.0)} if weighted else {}

    def step(params, state, grads):
        if form == "drop-in":
            updates, state = opt.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state
        emit = {"fused": None, "emit=False": False, "emit=True": True}[form]
        return optax_ext.apply_gradients(
            opt, grads, state, params, emit=emit, **extra
        )

    return step


@functools.lru_cache(maxsize=None)
def _compiled(backend, layout, inner, dtype, form, weighted=False):
    params = LAYOUTS[layout](jnp.dtype(dtype))
    tx = INNER[inner][0]()
    if form == "bare":
        opt, form = tx, "drop-in"
    else:
        opt = optax_ext.MultiSteps(tx, K, weighted=weighted)
    state = opt.init(params)
    compiled = compile_step(backend, _step(opt, form, weighted), params, state, params)
    shapes = {f"[{','.join(map(str, p.shape))}]" for p in params.values()}
    out = report(compiled, shapes, INNER[inner][1])
    out["params"] = _bytes(params)
    out["donated"] = _bytes(params) + _bytes(state)
    return out


def _check(backend, layout, inner, dtype, form, weighted=False):
    got = _compiled(backend, layout, inner, dtype, form, weighted)
    bare = _compiled(backend, layout, inner, dtype, "bare")
    return got, bare


@pytest.mark.parametrize("form", ["fused", "drop-in"])
@pytest.mark.parametrize("layout,inner,dtype", CASES)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_mini_step_runs_no_inner_optimizer(backend, layout, inner, dtype, form):
    """Every op of the inner optimizer is inside a conditional branch (and
    there are some: the check is not vacuous), and no params-leaf-shaped
    array is copied."""
    _skip_unless(backend)
    got, _ = _check(backend, layout, inner, dtype, form)
    assert got["conditionals"] >= 1, got
    assert got["markers_outside"] == 0, got
    assert got["markers_inside"] >= 1, got
    assert got["copies"] == [], got["copies"]


@pytest.mark.parametrize("form", ["fused", "drop-in"])
@pytest.mark.parametrize("layout,inner,dtype", CASES)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_temporary_memory_of_the_bare_step(backend, layout, inner, dtype, form):
    """Temporary memory at most the bare inner optimizer's train step's plus
    2% of the params' bytes (the drop-in step: plus the zero updates it
    returns, 1.0x). XLA:TPU keeps the branch temporaries of a chain that
    reduces over the updates (clip_by_global_norm), which it does not alias:
    there up to 1.0x more."""
    _skip_unless(backend)
    got, bare = _check(backend, layout, inner, dtype, form)
    slack = 0.02
    if backend == "tpu" and INNER[inner][2]:
        slack = 1.0
    if form == "drop-in":
        slack += 1.0
    bound = bare["temp"] + slack * got["params"]
    assert got["temp"] <= bound, (got["temp"] / got["params"], bare["temp"] / got["params"])


@pytest.mark.parametrize("form", ["fused", "drop-in"])
@pytest.mark.parametrize("layout,inner,dtype", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_buffers_are_handed_back(backend, layout, inner, dtype, form):
    """Every donated byte (params and state) comes back aliased."""
    _skip_unless(backend)
    got, _ = _check(backend, layout, inner, dtype, form)
    assert got["alias"] >= 0.999 * got["donated"], (got["alias"], got["donated"])
