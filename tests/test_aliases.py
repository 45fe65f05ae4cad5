"""Every optax alias through MultiSteps and inject_hyperparams.

The aliases are discovered at import (see `_aliases.py`): every function of
`optax` and `optax.contrib` with a `learning_rate` parameter that inits and
updates a small params dict (a 2-D and a 1-D leaf) without extra arguments.

Each test compares optax_ext with an independent reference built from the bare
alias (a second, fresh instance) and numpy, never with optax_ext's own output:

- MultiSteps emits what the bare optimizer gives on the window's mean (or
  sum), to a few ulps (bit for bit in float16 and bfloat16 when written),
  returns exact zeros on the other mini-steps, keeps every state leaf's shape,
  dtype and weak type, and leaves the inner state untouched between
  emissions; also with `zero_nans` in the chain (a NaN entered in one window
  must not reach the next) and with `skip_not_finite` (a skipped mini-step is
  as if it never happened).
- inject_hyperparams jits (`jax.jit(init)`, `jax.jit(update)`) with no
  `static_args`, and its updates equal the bare alias's, dtype included, with
  a constant learning rate and with a schedule.

Speed: each case jits `update` once and calls it per step (a stable state
means one compilation), rather than many small jitted pieces; references are
shared between the tests that need the same bare optimizer; and programs are
compiled with fast-compiling XLA CPU options (`_aliases.COMPILER_OPTIONS`).

The `test_upstream_*` tests show optax's own versions failing these contracts.
They assert optax's failure, so they will start failing if optax fixes it:
then delete them.
"""

from __future__ import annotations

import functools

import _aliases as A
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_ext

nan, inf = float("nan"), float("inf")

pytestmark = [
    # optax.noisy_sgd without `key=`: we rely on its default seed on purpose.
    pytest.mark.filterwarnings("ignore:Specifying a key will be required:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:`optimistic_adam` is deprecated:DeprecationWarning"
    ),
]

NAMES = A.NAMES
FLOATS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
K = 3  # mini-steps per window

_apply_updates = A.jit(optax.apply_updates)

# `name` and `dtype` are module-scoped parameters: pytest then orders every
# test of one (alias, dtype) together, across test functions, and pytest-xdist
# hands out consecutive tests, so the jitted reference below is usually
# compiled once per (alias, dtype) and shared by the tests that need the same
# bare optimizer.
by_name = pytest.mark.parametrize("name", NAMES, scope="module")


def by_dtype(*names):
    return pytest.mark.parametrize("dtype", names, scope="module")


# A dozen aliases whose states differ in kind (moments, factored moments,
# a sign's momentum, scalar estimates, matrix iterations, low-rank
# projections, schedule-free iterates, integer counts): the tests below
# run them in bfloat16 as well, every alias in float32.
NARROW = ["adafactor", "adam", "cocob", "galore", "lion", "muon", "novograd"]
NARROW += ["prodigy", "rprop", "schedule_free_adamw", "sgd", "sm3"]
by_name_float32_and_narrow_bfloat16 = pytest.mark.parametrize(
    "name,dtype",
    [(n, "float32") for n in NAMES] + [(n, "bfloat16") for n in NARROW],
    scope="module",
)


@functools.lru_cache(maxsize=8)
def _reference(name: str, kind: str):
    """A fresh bare optimizer (never the instance inside optax_ext) and its
    jitted update. kind: "make" (A.make(name)), "zero_nans" (optax's own
    zero_nans chained before it), "constant" (learning_rate=1e-2) or
    "schedule" (learning_rate=the schedule)."""
    if kind == "constant" and A.needs_learning_rate(name):
        return _reference(name, "make")
    if kind == "make":
        opt = A.make(name)
    elif kind == "zero_nans":
        opt = optax.chain(optax.zero_nans(), A.make(name))
    else:
        opt = A.ALIASES[name](learning_rate=_learning_rate(kind))
    return opt, A.jit(opt.update)


def _run_reference(name, kind, params, steps):
    """The bare optimizer's updates on `steps`, params updated in between."""
    opt, update = _reference(name, kind)
    state, out = opt.init(params), []
    for g in steps:
        updates, state = update(g, state, params)
        params = _apply_updates(params, updates)
        out.append(updates)
    return out


def test_narrow_aliases_are_discovered():
    """A renamed alias would drop out of the bfloat16 cases unseen."""
    assert set(NARROW) <= set(NAMES), sorted(set(NARROW) - set(NAMES))


def test_discovery_finds_the_known_aliases():
    # A floor, not an exact list: optax may add aliases. These 44 ran
    # without extra arguments when the suite was written (optax 0.2.8).
    known = (  # noqa: SIM905 - a list of 44 names reads better as words
        "adabelief adadelta adafactor adagrad adam adamax adamaxw adamw adan "
        "amsgrad fromage lamb lars lion noisy_sgd novograd optimistic_adam "
        "optimistic_adam_v2 optimistic_gradient_descent radam rmsprop rprop "
        "scale_by_learning_rate scale_by_rprop sgd sign_sgd signum sm3 yogi "
        "acprop ademamix adopt cocob dadapt_adamw dog dowg galore madgrad muon "
        "prodigy scale_by_madgrad schedule_free_adamw schedule_free_sgd "
        "simplified_ademamix"
    ).split()
    installed = [n for n in known if hasattr(optax, n) or hasattr(optax.contrib, n)]
    missing = [n for n in installed if n not in NAMES]
    assert not missing, missing
    assert sorted(NAMES) == NAMES


# --------------------------------------------------------------------------
# MultiSteps


def _bad(g, value):
    """A copy of gradient dict `g` with one non-finite entry."""
    return {**g, "w": g["w"].at[1, 2].set(value)}


def _scenario(variant: str, dtype):
    """The mini-step gradients, the windows the reference sees, and the
    indices of the emitting mini-steps."""
    g = A.grads(2 * K, dtype)
    if variant == "zero_nans":
        # A NaN enters the first window; zero_nans zeroes that entry of the
        # first window's mean, and the second window must be clean again.
        g[1] = _bad(g[1], nan)
        return g, [g[:K], g[K:]], [K - 1, 2 * K - 1]
    if variant == "skip_not_finite":
        # One non-finite mini-step in the middle of each window: skipped, as if
        # it never happened.
        steps = [g[0], _bad(g[1], nan), g[1], g[2], g[3], g[4], _bad(g[5], -inf), g[5]]
        return steps, [g[:K], g[K:]], [3, 7]
    return g, [g[:K], g[K:]], [K - 1, 2 * K - 1]


def _multisteps(name, variant, use_grad_mean=True):
    if variant == "zero_nans":
        inner = optax.chain(optax_ext.zero_nans(), A.make(name))
    else:
        inner = A.make(name)
    skip = optax.skip_not_finite if variant == "skip_not_finite" else None
    return optax_ext.MultiSteps(
        inner, K, use_grad_mean=use_grad_mean, should_skip_update_fn=skip
    )


def _run(opt, params, steps):
    """Eager `init`, then one jitted `update` per step; params are updated with
    `apply_updates` after each step. Returns (init state, [(updates, state)])."""
    state0 = opt.init(params)
    update = A.jit(opt.update)
    state, out = state0, []
    for g in steps:
        updates, state = update(g, state, params)
        params = _apply_updates(params, updates)
        out.append((updates, state))
    return state0, out


def _bits(tree):
    """Leaves as numpy arrays for exact comparison (typed keys as key data)."""
    return [
        np.asarray(jax.random.key_data(x))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else np.asarray(x)
        for x in jax.tree.leaves(tree)
    ]


# jax >= 0.12 (measured on 0.12.0.1): MultiSteps' emitted float16 updates of
# these aliases (all take a sqrt or a norm) differ from the bare alias's by 1
# float16 ulp at a few entries, with XLA's default compiler options too and
# with excess precision off. jax 0.8.1 and 0.10.2 match bit for bit (A.ULPS),
# and so keep the exact bound.
MULTISTEPS_ULPS = (
    {n: {jnp.dtype(jnp.float16): 1} for n in ("adadelta", "fromage", "lamb", "rmsprop")}
    if jax.__version_info__ >= (0, 12)
    else {}
)


def _check_multisteps(name, variant, dtype, use_grad_mean=True, form=None):
    """`form`: the `window_form` to build the `MultiSteps` in, if not its own."""
    dtype = jnp.dtype(dtype)
    params = A.params(dtype)
    steps, windows, emit_at = _scenario(variant, dtype)
    opt = _multisteps(name, variant, use_grad_mean)
    state0, out = _run(form(opt) if form else opt, params, steps)
    reduced = [A.window_reduce(w, dtype, mean=use_grad_mean) for w in windows]
    kind = "zero_nans" if variant == "zero_nans" else "make"
    ref_updates_per_window = _run_reference(name, kind, params, reduced)

    for i, (updates, state) in enumerate(out):
        A.assert_same_avals(state, state0, f"state after mini-step {i}")
        # The window this mini-step belongs to: its emission gives the dtype.
        window = next(j for j, e in enumerate(emit_at) if i <= e)
        ref_updates = ref_updates_per_window[window]
        if i in emit_at:
            A.assert_close(
                updates,
                ref_updates,
                f"emitted updates at mini-step {i}",
                ulps=MULTISTEPS_ULPS.get(name),
                **A.cross_program(name, steps=window + 1),
            )
        else:
            A.assert_exact_zeros(updates, ref_updates, f"updates at mini-step {i}")
            # The inner optimizer did not touch its state.
            before = out[i - 1][1] if i else state0
            for a, b in zip(
                _bits(state.inner_opt_state), _bits(before.inner_opt_state), strict=True
            ):
                assert np.array_equal(a, b, equal_nan=True), (
                    f"inner state changed at non-emitting mini-step {i}"
                )


@by_dtype(*FLOATS)
@by_name
def test_multisteps_emits_inner_on_window_mean(name, dtype):
    _check_multisteps(name, "plain", FLOATS[dtype])


@pytest.mark.parametrize("variant", ["zero_nans", "skip_not_finite"])
@by_name_float32_and_narrow_bfloat16
def test_multisteps_with_a_bad_value_emits_inner_on_window_mean(name, dtype, variant):
    """A NaN or inf entered in one window, with `zero_nans` in the chain
    or `skip_not_finite`: every alias in float32, `NARROW`'s in bfloat16
    (what handles a bad value is the same code for every floating dtype;
    the test above runs float16 with every alias)."""
    _check_multisteps(name, variant, FLOATS[dtype])


@pytest.mark.parametrize(
    "window_form",
    ["every step"],
    indirect=True,
)
@by_name_float32_and_narrow_bfloat16
def test_multisteps_in_the_other_form_emits_inner_on_window_mean(
    name, dtype, window_form
):
    """The same in the form of the window's step this environment does not
    get by itself (`tests/conftest.py::window_form`): the inner optimizer
    on every step, as on GPUs and TPUs, where XLA:CPU runs it in a
    conditional; every alias in float32, `NARROW`'s in bfloat16. float16
    takes bfloat16's path through the selection."""
    _check_multisteps(name, "plain", FLOATS[dtype], form=window_form)


@pytest.mark.parametrize(
    "name", [n for n in ("sgd", "adam", "lion", "muon") if n in NAMES]
)
def test_multisteps_sum_of_window(name, window_form):
    _check_multisteps(name, "plain", jnp.float32, use_grad_mean=False, form=window_form)


# --------------------------------------------------------------------------
# inject_hyperparams


def _learning_rate(kind):
    return (
        A.LEARNING_RATE if kind == "constant" else optax.linear_schedule(1e-2, 1e-3, 10)
    )


# Where optax_ext cannot match the bare alias, and why.
INJECT_XFAIL = {
    ("fromage", "bfloat16", "schedule"): (
        "bare optax.fromage takes another code path for a callable learning "
        "rate: it passes `add_decayed_weights` a schedule whose strongly typed "
        "float32 output promotes bfloat16 updates to float32. Injected, fromage "
        "is called with a number and takes its constant-learning-rate path, "
        "whose updates stay bfloat16 (as optax.fromage(1e-2)'s do)."
    ),
}


# Wider float32 bounds for inject_hyperparams, measured (every other alias is
# within A.ULPS): acprop's injected updates differ from the bare alias's by up
# to 55 float32 ulps beyond A.FLOOR at entries near zero (constant learning
# rate; 50 with the schedule); within 1e-5 of the leaf's largest update.
INJECT_ULPS = {"acprop": {jnp.dtype(jnp.float32): 64}}


@pytest.mark.parametrize("lr", ["constant", "schedule"])
@by_dtype("float32", "bfloat16")
@by_name
def test_inject_hyperparams_matches_bare(name, dtype, lr, request):
    reason = INJECT_XFAIL.get((name, dtype, lr))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    dtype = jnp.dtype(FLOATS[dtype])
    params, steps = A.params(dtype), A.grads(3, dtype)
    learning_rate = _learning_rate(lr)
    if lr == "schedule":
        try:
            want = _run_reference(name, lr, params, steps)
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"bare optax {name} does not take a schedule: {e!r:.200}")
    else:
        want = _run_reference(name, lr, params, steps)

    opt = optax_ext.inject_hyperparams(A.ALIASES[name])(learning_rate=learning_rate)
    state0 = A.jit(opt.init)(params)
    update = A.jit(opt.update)
    state = state0
    for i, (g, w) in enumerate(zip(steps, want, strict=True)):
        updates, state = update(g, state, params)
        A.assert_same_avals(state, state0, f"state after step {i}")
        A.assert_close(
            updates,
            w,
            f"updates at step {i}",
            ulps=INJECT_ULPS.get(name),
            **A.cross_program(name, steps=i + 1),
        )
        params = _apply_updates(params, updates)
    assert update._cache_size() == 1, "jit(update) compiled more than once"
    if lr == "schedule":
        np.testing.assert_allclose(
            float(state.hyperparams["learning_rate"]),
            float(optax.linear_schedule(1e-2, 1e-3, 10)(2)),
            rtol=1e-6,
        )


# --------------------------------------------------------------------------
# The same contracts fail in optax itself. These assert optax's failure: if
# optax fixes one, its test fails and can be deleted.


def _bf16_adam_case():
    p = {"w": jnp.ones(4, jnp.bfloat16)}
    g = {"w": jnp.full(4, 0.1, jnp.bfloat16)}
    return p, g


def _first_update(opt, g, p):
    return A.jit(opt.update)(g, A.jit(opt.init)(p), p)[0]


def test_upstream_inject_bf16_adam_is_nan():
    # optax casts b2=0.999 to bfloat16 (1.0): the bias correction divides by 0.
    p, g = _bf16_adam_case()
    bare = _first_update(optax.adam(1e-2), g, p)
    assert np.isfinite(A.f32(bare["w"])).all()
    upstream = _first_update(optax.inject_hyperparams(optax.adam)(1e-2), g, p)
    assert np.isnan(A.f32(upstream["w"])).all()  # upstream failure
    ours = _first_update(optax_ext.inject_hyperparams(optax.adam)(1e-2), g, p)
    A.assert_close(ours, bare, "optax_ext bf16 adam")


def test_upstream_inject_schedule_changes_update_dtype():
    p, g = _bf16_adam_case()
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    want = _first_update(optax.adam(schedule), g, p)
    assert want["w"].dtype == jnp.bfloat16
    upstream = _first_update(optax.inject_hyperparams(optax.adam)(schedule), g, p)
    assert upstream["w"].dtype == jnp.float32  # upstream failure
    ours = _first_update(optax_ext.inject_hyperparams(optax.adam)(schedule), g, p)
    A.assert_close(ours, want, "optax_ext bf16 adam with a schedule")


def test_upstream_inject_adafactor_jit_init_fails():
    params = A.params(jnp.float32)
    o = optax.inject_hyperparams(optax.adafactor)(learning_rate=1e-2)
    with pytest.raises(jax.errors.TracerBoolConversionError):  # upstream failure
        jax.jit(o.init)(params)
    jax.jit(optax_ext.inject_hyperparams(optax.adafactor)(learning_rate=1e-2).init)(
        params
    )


def test_upstream_inject_adopt_jit_fails():
    # optax takes adopt's `clip_value_fn` for a schedule and calls it with the
    # step count; the result is then called as a function.
    if not hasattr(optax.contrib, "adopt"):
        pytest.skip("this optax has no contrib.adopt")
    params = A.params(jnp.float32)
    o = optax.inject_hyperparams(optax.contrib.adopt)(learning_rate=1e-2)
    state = jax.jit(o.init)(params)
    with pytest.raises(TypeError, match="not callable"):  # upstream failure
        jax.jit(o.update)(params, state, params)
    o = optax_ext.inject_hyperparams(optax.contrib.adopt)(learning_rate=1e-2)
    jax.jit(o.update)(params, jax.jit(o.init)(params), params)


def test_upstream_multisteps_nan_freezes_entry():
    # optax resets the accumulator by multiplying by 0: a NaN stays forever,
    # and with zero_nans the entry gets a zero update at every later emission.
    steps, windows, emit_at = _scenario("zero_nans", jnp.float32)
    params = A.params(jnp.float32)
    reference = optax.chain(optax.zero_nans(), optax.sgd(1.0))
    mean = A.window_reduce(windows[1], jnp.float32)
    want = reference.update(mean, reference.init(params))[0]
    ms = optax.MultiSteps(optax.chain(optax.zero_nans(), optax.sgd(1.0)), K)
    _, out = _run(ms, params, steps)
    assert A.f32(want["w"])[1, 2] != 0
    assert A.f32(out[-1][0]["w"])[1, 2] == 0  # upstream failure
    ms = optax_ext.MultiSteps(optax.chain(optax_ext.zero_nans(), optax.sgd(1.0)), K)
    _, out = _run(ms, params, steps)
    A.assert_close(out[-1][0], want, "optax_ext second window")


def test_upstream_multisteps_inf_gives_nan_on_accumulating_step():
    # optax returns `emit * inner_update`, and 0 * inf is NaN.
    params = A.params(jnp.float32)
    g = _bad(A.grads(1, jnp.float32)[0], inf)
    updates = _first_update(optax.MultiSteps(optax.sgd(1.0), K), g, params)
    assert np.isnan(A.f32(updates["w"])).any()  # upstream failure
    updates = _first_update(optax_ext.MultiSteps(optax.sgd(1.0), K), g, params)
    A.assert_exact_zeros(updates, params, "optax_ext")
