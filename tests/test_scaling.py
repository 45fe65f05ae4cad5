"""How compile cost grows with the model: traces of the inner optimizer and
compiled HLO size per leaf, in the train step users write (both exact, so
asserted; compile seconds are measured in benchmarks/compile_time.py).

Real models have hundreds of leaves. The per-leaf flags that once kept the
accumulator in place were duplicated by XLA into every leaf's loop: compiled
ops grew as leaves^2, invisible with a dozen leaves.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import xla_cpu_only

import optax_ext

COMPILED = xla_cpu_only("compiled module size and memory analysis")


def counting(inner: optax.GradientTransformation, calls: list):
    """`inner`, appending to `calls` each time its `update` is traced."""

    def update(updates, state, params=None, **extra):
        calls.append(1)
        return inner.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _params(n, shape=(16, 16)):
    return {f"w{i:04d}": jnp.full(shape, 0.01 * (i + 1), jnp.float32) for i in range(n)}


def _train_step(opt, **extra):
    def step(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def _lower(opt, params, **extra):
    return _train_step(opt, **extra).lower(params, opt.init(params), params)


def _nestings(leaf):
    """Wrappers around the counted optimizer `leaf()`, by name."""
    ms = optax_ext.MultiSteps
    inject = optax_ext.inject_hyperparams
    return {
        "MultiSteps": lambda: ms(leaf(), 2),
        "MultiSteps^2": lambda: ms(ms(leaf(), 2), 3),
        "MultiSteps^3": lambda: ms(ms(ms(leaf(), 2), 3), 2),
        "skip_when": lambda: optax_ext.skip_when(leaf()),
        "MultiSteps(skip_when)": lambda: ms(optax_ext.skip_when(leaf()), 2),
        "skip_when(MultiSteps)": lambda: optax_ext.skip_when(ms(leaf(), 2)),
        "MultiSteps(chain(zero_nans, skip_when(MultiSteps)))": lambda: ms(
            optax.chain(optax_ext.zero_nans(), optax_ext.skip_when(ms(leaf(), 2))), 2
        ),
        "MultiSteps(inject)": lambda: ms(
            inject(lambda learning_rate: optax.chain(leaf(), optax.scale(-1.0)))(
                learning_rate=optax.linear_schedule(0.0, 1e-3, 10)
            ),
            2,
        ),
    }


NESTINGS = list(_nestings(None))


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("nesting", NESTINGS)
def test_inner_update_is_traced_once(nesting, form):
    """A jitted train step traces the innermost optimizer's `update` exactly
    once, however deeply `MultiSteps`, `skip_when` and `inject_hyperparams`
    nest (each level used to trace it twice: 2, 4, 8 at depths 1-3), in the
    drop-in form and in the fused one."""
    calls = []
    opt = _nestings(lambda: counting(optax.adam(1e-3), calls))[nesting]()
    params = _params(3)
    state = opt.init(params)
    calls.clear()  # init may trace updates abstractly; only `update` counts
    extra = {"skip": jnp.asarray(False)} if "skip_when" in nesting else {}
    if form == "update":
        step = _train_step(opt, **extra)
    else:
        step = jax.jit(
            lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p, **extra),
            donate_argnums=(0, 1),
        )
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    new_params, state = step(params, state, grads)
    assert len(calls) == 1, (nesting, len(calls))
    # and the traced function is the one that runs: a second call with new
    # buffers reuses it
    step(new_params, state, grads)
    assert len(calls) == 1


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_inner_update_runs_once_with_jit_disabled(depth):
    """Under `jax.disable_jit()` nothing is cached: the inner update still
    runs once per step (calling the traced `jit` in the branch ran it again
    at every level, 2, 4, 8 times), with the jitted step's dtypes and values
    (to an ulp), also where it returns NumPy constants (float64 ones
    included)."""
    calls = []
    opt = counting(optax.adam(1e-2), calls)
    for _ in range(depth):
        opt = optax_ext.MultiSteps(opt, 1)  # every level emits
    params = _params(2)
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    state = opt.init(params)
    calls.clear()
    with jax.disable_jit():
        eager, _ = opt.update(grads, state, params)
    assert len(calls) == 1
    jitted, _ = jax.jit(opt.update)(grads, state, params)
    for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        assert e.dtype == j.dtype
        # op by op against fused loops: FMA contraction may differ by an ulp
        np.testing.assert_allclose(np.asarray(e), np.asarray(j), rtol=1e-6)

    def constant(grads, state, params=None):
        return jax.tree.map(lambda g: np.full(g.shape, 0.5), grads), state

    inner = optax.GradientTransformation(lambda p: (), constant)
    const = optax_ext.MultiSteps(inner, 1)
    with jax.disable_jit():
        updates, _ = const.update(grads, const.init(params), params)
    assert all(
        isinstance(u, jax.Array) and u.dtype == jnp.float32
        for u in jax.tree.leaves(updates)
    )


def _counted_adam(inits: list, updates: list) -> optax.GradientTransformation:
    """Adam, appending to `inits` and `updates` each time one is traced."""
    inner = optax.adam(1e-3)

    def init(params):
        inits.append(1)
        return inner.init(params)

    def update(grads, state, params=None, **extra):
        updates.append(1)
        return inner.update(grads, state, params)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize(
    "nesting", ["MultiSteps", "MultiSteps^2", "MultiSteps(inject)"]
)
def test_step_traces_no_inner_init_after_init(nesting):
    """`MultiSteps.update` checks the state's inner state against the
    structure the inner init builds. `init` records that structure, so the
    jitted step traces no inner init for params `init` has seen (an injected
    factory's init traced its init and update again for the check: a third
    of the trace)."""
    inits, updates = [], []
    opt = _nestings(lambda: _counted_adam(inits, updates))[nesting]()
    params = _params(3)
    state = opt.init(params)
    inits.clear()
    updates.clear()
    _train_step(opt)(params, state, jax.tree.map(lambda p: 0.5 * p, params))
    assert (len(inits), len(updates)) == (0, 1), nesting
    # A state of another optimizer is still refused.
    with pytest.raises(TypeError, match="inner_opt_state"):
        opt.update(params, opt.init(params)._replace(inner_opt_state=()), params)


def test_injected_factory_is_tried_once_per_kind_of_params():
    """`inject_hyperparams`' init traces the factory to find the numbers it
    cannot take traced; a second init with params of the same shapes and
    dtypes reuses that answer."""
    inits, updates = [], []
    opt = optax_ext.inject_hyperparams(
        lambda learning_rate: optax.chain(
            _counted_adam(inits, updates), optax.scale(-learning_rate)
        )
    )(learning_rate=1e-3)
    params = _params(3)
    opt.init(params)
    assert updates  # the trial traced an update
    updates.clear()
    opt.init(jax.tree.map(lambda p: p + 1, params))
    assert updates == []
    opt.init(_params(4))  # another tree: tried again
    assert updates


def _instructions(compiled) -> int:
    """Instructions of the compiled HLO module, every computation included."""
    return sum(1 for line in compiled.as_text().splitlines() if " = " in line)


SIZES = (16, 48, 144)
WRAPPERS = {
    "MultiSteps(adam)": lambda: optax_ext.MultiSteps(optax.adam(1e-3), 4),
    # lion: its new `mu` is ordered after the updates that read the old one
    "MultiSteps(lion)": lambda: optax_ext.MultiSteps(optax.lion(1e-4), 4),
    "MultiSteps(MultiSteps(adamw))": lambda: optax_ext.MultiSteps(
        optax_ext.MultiSteps(optax.adamw(1e-3), 2), 2
    ),
    "skip_when(chain(clip, adamw))": lambda: optax_ext.skip_when(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ),
    "MultiSteps(skip_when(lion))": lambda: optax_ext.MultiSteps(
        optax_ext.skip_when(optax.lion(1e-4)), 4
    ),
    "MultiSteps(inject_hyperparams(adamw))": lambda: optax_ext.MultiSteps(
        optax_ext.inject_hyperparams(optax.adamw)(
            learning_rate=optax.linear_schedule(0.0, 1e-3, 10)
        ),
        4,
    ),
}


@functools.cache
def _size(name: str, n: int) -> int:
    extra = {"skip": jnp.asarray(False)} if "skip_when" in name else {}
    return _instructions(_lower(WRAPPERS[name](), _params(n), **extra).compile())


@COMPILED
@pytest.mark.parametrize("name", WRAPPERS)
def test_compiled_size_is_linear_in_leaves(name):
    """Compiled instructions per added leaf are the same from 16 to 48 and
    from 48 to 144 leaves (within 2%: a few shared scalars and tables), so
    the compiled module, and with it the compile time, grows linearly. The
    quadratic ordering flags gave 4x per-leaf growth for 2x leaves."""
    small, mid, large = (_size(name, n) for n in SIZES)
    first = (mid - small) / (SIZES[1] - SIZES[0])
    second = (large - mid) / (SIZES[2] - SIZES[1])
    assert abs(second / first - 1) < 0.02, (small, mid, large, first, second)


@COMPILED
def test_compiled_size_per_leaf_at_most_optax():
    """Per leaf, the compiled MultiSteps train step holds no more
    instructions than optax.MultiSteps' (which has no conditional and no
    ordering: a bound on the machinery's cost)."""
    params = _params(96)
    ours = _instructions(_lower(WRAPPERS["MultiSteps(adam)"](), params).compile())
    theirs = _instructions(
        _lower(optax.MultiSteps(optax.adam(1e-3), 4), params).compile()
    )
    assert ours <= theirs, (ours, theirs)


@functools.cache
def _train_step_temp(name: str, n: int) -> int:
    """Compiled temporary bytes of the drop-in train step of a lion
    composition with `n` leaves of (16, 24), skip flag traced."""
    ms, sw = optax_ext.MultiSteps, optax_ext.skip_when
    make = {
        "MultiSteps": lambda: ms(optax.lion(1e-4), 4),
        "MultiSteps(skip_when)": lambda: ms(sw(optax.lion(1e-4)), 4),
        "skip_when(MultiSteps)": lambda: sw(ms(optax.lion(1e-4), 4)),
    }[name]
    opt = make()
    params = _params(n, (16, 24))
    extra = {"skip": jnp.asarray(False)} if "skip_when" in name else {}

    def step(params, opt_state, grads, extra):
        updates, opt_state = opt.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, opt.init(params), params, extra
    )
    return lowered.compile().memory_analysis().temp_size_in_bytes


@COMPILED
@pytest.mark.parametrize("nesting", ["MultiSteps(skip_when)", "skip_when(MultiSteps)"])
def test_skip_when_with_multi_steps_needs_no_temporary_at_300_leaves(nesting):
    """skip_when nested in or around MultiSteps with a traced flag, at 300
    leaves: skip_when(MultiSteps) adds the conditionals' buffer tables (a
    few dozen KiB here), never a params-sized buffer; MultiSteps(skip_when)
    adds one, the window's mean, which skip_when's own conditional takes as
    an operand (a buffer, in the float32 accumulator's dtype), and no more."""
    n = 300
    params_bytes = n * 16 * 24 * 4
    extra = _train_step_temp(nesting, n) - _train_step_temp("MultiSteps", n)
    if nesting == "MultiSteps(skip_when)":
        assert extra < params_bytes * 1.1, (extra, params_bytes)
    else:
        assert extra < params_bytes / 4, (extra, params_bytes)
