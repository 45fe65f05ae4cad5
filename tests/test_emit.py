"""`apply_gradients(..., emit=)`: a training loop that knows on the host
which step ends a window compiles the mini-step and the emitting step
apart, neither with a conditional. References: plain optax on the window's
mean computed in float64, and the loop without `emit`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import xla_cpu_only

import optax_ext

K = 4
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.ones(6)}


def _grads(t):
    rng = np.random.default_rng(t)
    return jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS
    )


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step(opt, params, state, grads, emit):
    return optax_ext.apply_gradients(opt, grads, state, params, emit=emit)


@jax.jit
def _reference_step(params, state, mean):
    updates, state = optax.adamw(1e-2).update(mean, state, params)
    return optax.apply_updates(params, updates), state


def _mean64(grads):
    return jax.tree.map(
        lambda *g: jnp.asarray(np.mean([np.float64(x) for x in g], 0), jnp.float32),
        *grads,
    )


def _close(got, want, tol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_host_chosen_windows_equal_optax_on_the_window_mean(window_form):
    """Three windows of K mini-steps, the last of each with `emit=True`:
    the params after each window are optax's adamw step on the window's
    mean (float64, rounded once), the params between emitting steps are
    unchanged, and the counters are those of the conditional form."""
    opt = window_form(optax_ext.MultiSteps(optax.adamw(1e-2), K))
    params, state = PARAMS, opt.init(PARAMS)
    ref_params, ref_state = PARAMS, optax.adamw(1e-2).init(PARAMS)
    t = 0
    for _ in range(3):
        window = []
        for j in range(K):
            g = _grads(t)
            window.append(g)
            before = params
            params, state = _step(opt, params, state, g, j == K - 1)
            if j < K - 1:
                for a, b in zip(
                    jax.tree.leaves(params), jax.tree.leaves(before), strict=True
                ):
                    np.testing.assert_array_equal(a, b)
            t += 1
        ref_params, ref_state = _reference_step(ref_params, ref_state, _mean64(window))
        _close(params, ref_params)
        assert int(state.mini_step) == 0 and bool(opt.has_updated(state))
    assert int(state.gradient_step) == 3
    # The last window's mean, which the next window's first fold overwrites;
    # zeros as optax.MultiSteps holds it.
    _close(state.acc_grads, _mean64(window))
    acc = opt.optax_state(state).acc_grads
    assert all(not np.any(np.asarray(a)) for a in jax.tree.leaves(acc))


def test_host_decides_when_it_disagrees_with_the_window():
    """The documented rule: `emit=True` closes the window on this step, on
    the mean of the mini-steps it holds (2 here, with K = 4); `emit=False`
    never runs the inner optimizer, even past K; a step without `emit`
    afterwards closes the longer window (its mini-step count reached K)."""
    opt = optax_ext.MultiSteps(optax.adamw(1e-2), K)
    state = opt.init(PARAMS)
    ref_state = optax.adamw(1e-2).init(PARAMS)
    g0, g1 = _grads(0), _grads(1)
    params, state = _step(opt, PARAMS, state, g0, False)
    params, state = _step(opt, params, state, g1, True)
    want, ref_state = _reference_step(PARAMS, ref_state, _mean64([g0, g1]))
    _close(params, want)
    window = [_grads(t) for t in range(2, 8)]  # 6 mini-steps, > K
    for g in window[:-1]:
        before = params
        params, state = _step(opt, params, state, g, False)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
    assert int(state.mini_step) == 5
    params, state = _step(opt, params, state, window[-1], None)
    want, ref_state = _reference_step(want, ref_state, _mean64(window))
    _close(params, want)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


def test_skipped_emitting_step_and_weight_zero_window_leave_params():
    """Skip functions and weights keep their contract: an emitting step that
    the skip function rejects (a NaN gradient) leaves the params, the inner
    state and the window as they were; a weighted window whose weights sum
    to 0 ends without running the inner optimizer."""
    opt = optax_ext.MultiSteps(
        optax.adamw(1e-2), K, should_skip_update_fn=optax.skip_not_finite
    )
    state = opt.init(PARAMS)
    params, state = _step(opt, PARAMS, state, _grads(0), False)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(1))
    params, after = _step(opt, params, state, bad, True)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(after.mini_step) == 1 and int(after.gradient_step) == 0
    for a, b in zip(
        jax.tree.leaves(after.acc_grads), jax.tree.leaves(state.acc_grads), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    weighted = optax_ext.MultiSteps(optax.adamw(1e-2), K, weighted=True)
    step = jax.jit(
        lambda p, s, g, w, emit: optax_ext.apply_gradients(
            weighted, g, s, p, emit=emit, weight=w
        ),
        static_argnums=4,
    )
    state = weighted.init(PARAMS)
    params, state = step(PARAMS, state, _grads(0), 0.0, False)
    params, state = step(params, state, _grads(1), 0.0, True)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state.gradient_step) == 0 and int(state.mini_step) == 0


def test_emit_is_checked():
    opt = optax_ext.MultiSteps(optax.sgd(1.0), K)
    state = opt.init(PARAMS)
    with pytest.raises(TypeError, match=r"emit must be a bool known on the host.*got"):
        optax_ext.apply_gradients(opt, PARAMS, state, PARAMS, emit=jnp.asarray(True))
    with pytest.raises(TypeError, match=r"cannot be a JAX array"):
        optax_ext.apply_gradients(opt, PARAMS, state, PARAMS, emit=jnp.asarray(True))
    for wrong in (np.int64(1), 1, np.array([True]), "yes"):
        with pytest.raises(TypeError, match=r"emit must be a bool known"):
            optax_ext.apply_gradients(opt, PARAMS, state, PARAMS, emit=wrong)
    with pytest.raises(TypeError, match=r"emit= chooses .*MultiSteps"):
        tx = optax.sgd(1.0)
        optax_ext.apply_gradients(tx, PARAMS, tx.init(PARAMS), PARAMS, emit=True)
    tx = optax_ext.skip_when(optax.sgd(1.0))
    with pytest.raises(TypeError, match=r"emit= chooses .*MultiSteps"):
        optax_ext.apply_gradients(tx, PARAMS, tx.init(PARAMS), PARAMS, emit=False)
    # its gradient_transformation() is a MultiSteps too
    gt = opt.gradient_transformation()
    optax_ext.apply_gradients(gt, PARAMS, state, PARAMS, emit=False)


def test_numpy_bools_choose_as_python_bools():
    """`step % k == k - 1` with a NumPy step gives a NumPy bool: the same
    results as the Python bool, for a mini-step and an emitting step."""
    opt = optax_ext.MultiSteps(optax.adamw(1e-2), 2)
    state = opt.init(PARAMS)
    step = np.int64(1)
    for t, python, numpy in [
        (0, False, [np.bool_(False), np.asarray(False)]),
        (1, True, [step % 2 == 1, np.asarray(True)]),
    ]:
        want = optax_ext.apply_gradients(opt, _grads(t), state, PARAMS, emit=python)
        for emit in numpy:
            got = optax_ext.apply_gradients(opt, _grads(t), state, PARAMS, emit=emit)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(a, b)
        state = want[1]
    assert not np.array_equal(want[0]["w"], PARAMS["w"])


@pytest.mark.parametrize("inner", ["adam", "adafactor", "lion"])
def test_host_chosen_steps_keep_every_state_aval(inner):
    """Mixed bfloat16 and float32 params: after `emit=False` and
    `emit=True` steps every state leaf keeps init's dtype, shape and weak
    type (Adam's bfloat16 `mu` stays bfloat16 beside a float32 leaf), so
    the jitted steps compile once each."""
    tx = {"adam": optax.adam, "adafactor": optax.adafactor, "lion": optax.lion}
    opt = optax_ext.MultiSteps(tx[inner](1e-2), 2)
    params = {"w": PARAMS["w"].astype(jnp.bfloat16), "b": PARAMS["b"]}
    state = opt.init(params)

    def avals(tree):
        return [
            (x.shape, x.dtype, getattr(x, "weak_type", False))
            for x in jax.tree.leaves(jax.tree.map(jax.typeof, tree))
        ]

    want = avals(state)
    traces = []

    @functools.partial(jax.jit, static_argnums=3)
    def step(params, state, grads, emit):
        traces.append(emit)
        return optax_ext.apply_gradients(opt, grads, state, params, emit=emit)

    for t in range(6):
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), _grads(t), params)
        params, state = step(params, state, grads, t % 2 == 1)
        assert avals(state) == want, t
    assert sorted(traces) == [False, True]


def _host_loop(opt, params, state, steps, start, mini):
    """The documented loop: the host counts the window's mini-steps from
    `mini` and passes `emit=`; returns the params, the state and the steps
    where `emits_next` disagreed with the host's choice."""
    disagreed = []
    for t in range(start, start + steps):
        emit = mini == K - 1
        if opt.emits_next(state) != emit:
            disagreed.append(t)
        params, state = _step(opt, params, state, _grads(t), emit)
        mini = 0 if emit else mini + 1
    return params, state, disagreed


def test_resumed_host_loop_counts_from_the_state():
    """A run stopped mid-window and resumed from its state (a checkpoint
    round trip through NumPy): counting from `int(state.mini_step)`, it
    equals the run that never stopped, bit for bit; restarting the count
    at 0 (a step counter not checkpointed) closes a window of 2 and then
    of 6, and `emits_next` flags the first disagreement."""
    opt = optax_ext.MultiSteps(optax.adamw(1e-2), K)
    whole, _, disagreed = _host_loop(opt, PARAMS, opt.init(PARAMS), 12, 0, 0)
    assert disagreed == []

    params, state, _ = _host_loop(opt, PARAMS, opt.init(PARAMS), 6, 0, 0)
    params, state = jax.tree.map(jnp.asarray, jax.device_get((params, state)))
    assert int(state.mini_step) == 2
    resumed, _, disagreed = _host_loop(opt, params, state, 6, 6, int(state.mini_step))
    assert disagreed == []
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)

    lost, _, disagreed = _host_loop(opt, params, state, 6, 6, 0)
    assert disagreed[0] == 7  # the window's 4th mini-step, the host's 2nd
    assert not np.allclose(lost["w"], whole["w"])


def test_with_skips_the_loop_asks_emits_next_and_equals_the_fused_step():
    """The docs' rule for `should_skip_update_fn`: a skipped step does not
    count, so a host count closes a window of more than K mini-steps after
    a skip; choosing `emit=opt.emits_next(state)` on every step gives the
    fused step's params, bit for bit (the same folds and inner step)."""
    opt = optax_ext.MultiSteps(
        optax.adamw(1e-2), K, should_skip_update_fn=optax.skip_not_finite
    )
    fused = jax.jit(lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p))
    grads = [_grads(t) for t in range(10)]
    grads[3] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[3])  # an emit
    want, want_state = PARAMS, opt.init(PARAMS)
    asked, asked_state = PARAMS, opt.init(PARAMS)
    counted, counted_state, mini = PARAMS, opt.init(PARAMS), 0
    for g in grads:
        want, want_state = fused(want, want_state, g)
        asked, asked_state = _step(
            opt, asked, asked_state, g, opt.emits_next(asked_state)
        )
        emit = mini == K - 1
        counted, counted_state = _step(opt, counted, counted_state, g, emit)
        mini = 0 if emit else mini + 1
    assert int(want_state.gradient_step) == 2
    for a, b in zip(jax.tree.leaves(asked), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    # The host count emitted at step 3 (skipped) and closed the window at
    # step 7 with 7 mini-steps; the second window is still open.
    assert int(counted_state.gradient_step) == 1
    seven = [grads[t] for t in (0, 1, 2, 4, 5, 6, 7)]
    once, _ = _reference_step(PARAMS, optax.adamw(1e-2).init(PARAMS), _mean64(seven))
    _close(counted, once)


def test_a_window_held_open_past_k_has_no_optax_state():
    """`optax_state` of a window that `emit=False` held open past K gave
    optax a `mini_step` of 6 with K = 4: optax emits only at K - 1, so it
    never closed the window and dropped its gradients, with no error. It is
    refused; once that window closes, optax's next window, from the
    converted state, equals optax_ext's (plain optax on the window's mean)."""
    opt = optax_ext.MultiSteps(optax.adamw(1e-2), K)
    params, state = PARAMS, opt.init(PARAMS)
    for t in range(K + 2):
        params, state = _step(opt, params, state, _grads(t), False)
        if t < K - 1:
            opt.optax_state(state)
        else:  # from K mini-steps on: optax emits at K - 1 only
            with pytest.raises(
                ValueError,
                match=rf"holds {t + 1} mini-steps, not closed at its length 4",
            ):
                opt.optax_state(state)
    params, state = _step(opt, params, state, _grads(K + 2), True)
    theirs = optax.MultiSteps(optax.adamw(1e-2), K)
    moved = opt.optax_state(state)
    window = [_grads(t) for t in range(10, 10 + K)]
    for g in window:
        updates, moved = jax.jit(theirs.update)(g, moved, params)
        optax_params = optax.apply_updates(params, updates)
    want, _ = _reference_step(params, state.inner_opt_state, _mean64(window))
    _close(optax_params, want, tol=2e-6)


def test_emits_next_inside_jit_says_to_call_it_outside():
    """It reads the counters on the host: traced ones get a clear error, not
    a `ConcretizationTypeError` from deep inside."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2)
    state = opt.init(jnp.zeros(2))
    with pytest.raises(TypeError, match=r"emits_next got traced counters.*outside"):
        jax.jit(opt.emits_next)(state)


def test_emits_next_refuses_what_the_jitted_update_refuses():
    """`emits_next` reads the schedule as the jitted `update` does: a window
    length known while tracing must be a whole number from 1 (0 and 2.5 are
    refused by both), a traced one is handled at run time (0 never emits,
    2.5 closes at 3), where both answer."""
    for k in (lambda s: 0, lambda s: 2.5):
        opt = optax_ext.MultiSteps(optax.sgd(1.0), k)
        state = opt.init(PARAMS)
        with pytest.raises(ValueError, match="every_k_schedule returned"):
            opt.emits_next(state)
        with pytest.raises(ValueError, match="every_k_schedule returned"):
            jax.jit(opt.update)(PARAMS, state, PARAMS)
    # A schedule in Python control flow runs with an eager `update` only,
    # and is read as that reads it (it failed once `emits_next` traced it).
    opt = optax_ext.MultiSteps(optax.sgd(1.0), lambda s: 2 if s < 10 else 4)
    state, answers = opt.init(PARAMS), []
    for _ in range(3):
        answers.append(opt.emits_next(state))
        opt.optax_state(state)
        _, state = opt.update(PARAMS, state, PARAMS)
    assert answers == [False, True, False]
    traced = {0: [False] * 4, 2.5: [False, False, True, False]}
    for k, want in traced.items():
        opt = optax_ext.MultiSteps(
            optax.sgd(1.0), lambda s, k=k: jnp.float32(k) + 0 * s
        )
        state, answers = opt.init(PARAMS), []
        for _ in range(4):
            answers.append(opt.emits_next(state))
            _, state = jax.jit(opt.update)(PARAMS, state, PARAMS)
        assert answers == want, k


@xla_cpu_only("compiled HLO of the host-chosen steps")
@pytest.mark.parametrize("emit", [False, True])
def test_host_chosen_steps_hold_no_conditional(emit):
    """Neither program has a conditional; the mini-step has no `sqrt`
    (Adam's), the emitting step one per leaf. (XLA:GPU and XLA:TPU:
    tests/test_compiled_backends.py.)"""
    opt = optax_ext.MultiSteps(optax.adamw(1e-2), K)
    state = opt.init(PARAMS)
    text = (
        jax.jit(
            lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p, emit=emit),
            donate_argnums=(0, 1),
        )
        .lower(PARAMS, state, PARAMS)
        .compile()
        .as_text()
    )
    assert " conditional(" not in text
    assert text.count(" sqrt(") == (len(PARAMS) if emit else 0)


def test_traced_emit_says_how_to_keep_it_static():
    """Under `eqx.filter_jit` a NumPy bool is traced: the error says to
    make `emit` static or pass a Python bool, and both ways work."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), K)
    state = opt.init(PARAMS)

    @eqx.filter_jit
    def filtered(params, state, emit):
        return optax_ext.apply_gradients(opt, params, state, params, emit=emit)

    with pytest.raises(TypeError, match=r"static_argnames='emit'.*Python bool"):
        filtered(PARAMS, state, np.bool_(True))
    want = filtered(PARAMS, state, True)

    @functools.partial(jax.jit, static_argnames="emit")
    def static(params, state, emit):
        return optax_ext.apply_gradients(opt, params, state, params, emit=emit)

    for emit in (True, np.bool_(True)):
        got = static(PARAMS, state, emit)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
