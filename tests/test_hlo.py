"""What XLA compiles for a MultiSteps update: exact, so asserted here.

Timings live in benchmarks/; the compiled HLO and memory analysis are exact
and tell whether a mini-step does more than accumulate.
"""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _helpers import hlo_computations, skip_cpu_memory_before_0_10_2, xla_cpu_only

import optax_ext

COMPILED = xla_cpu_only(
    "compiled HLO (branches, copies, buffer aliasing) and memory analysis"
)

INNER = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "muon": lambda: optax.contrib.muon(1e-3),
}
PARAMS = {f"w{i}": jnp.zeros((32 * (i + 1), 48)) for i in range(4)}
GRADS = jax.tree.map(jnp.ones_like, PARAMS)
NEVER = 1_000_000  # every_k_schedule of a step that does not emit
# Temporary bytes allowed for a conditional's tables of operand and result
# buffers (8 bytes a buffer, a few tables); far below any params leaf here, so
# a params-sized temporary cannot hide in it.
TABLES = 2048
assert min(p.nbytes for p in PARAMS.values()) > TABLES


def _compile(tx, donate=(0, 1)):
    state = tx.init(PARAMS)
    fn = jax.jit(lambda g, s: tx.update(g, s, PARAMS), donate_argnums=donate)
    return fn.lower(GRADS, state).compile(), state


def _aliased_pairs(compiled) -> dict[int, int]:
    """{output leaf index: donated parameter index} from the HLO header."""
    header = compiled.as_text().splitlines()[0]
    found = re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header)
    return {int(out): int(param) for out, param in found}


def _size(instruction: str) -> int:
    """The number of elements of an instruction's (array) result."""
    dims = re.match(r"(?:ROOT )?%\S+ = \w+\[([\d,]*)\]", instruction).group(1)
    return math.prod(int(d) for d in dims.split(",") if d)


def _array_copies(lines: list[str]) -> list[str]:
    """Copies of non-scalar buffers, apart from materialising a constant."""
    return [
        line
        for line in lines
        if _opcode(line) == "copy" and "[]" not in line.split(" copy(")[0]
        and "broadcast" not in line.split(" copy(")[1]
    ]  # fmt: skip


def _temp_bytes(tx) -> int:
    return _compile(tx)[0].memory_analysis().temp_size_in_bytes


def _opcode(instruction: str) -> str:
    return re.match(r"(?:ROOT )?%\S+ = .*? ([a-z][\w-]*)\(", instruction).group(1)


def _opcodes(compiled) -> list[str]:
    """The opcode of every instruction of a compiled module, all
    computations together."""
    return [
        _opcode(line)
        for lines in hlo_computations(compiled.as_text()).values()
        for line in lines
        if re.match(r"(?:ROOT )?%\S+ = .*? [a-z][\w-]*\(", line)
    ]


@COMPILED
@pytest.mark.parametrize("inner", INNER)
def test_donated_state_is_updated_in_place(inner):
    """With gradients and state donated, every state leaf's buffer is handed
    back as the same leaf of the new state (no leaf is moved or copied)."""
    compiled, state = _compile(optax_ext.MultiSteps(INNER[inner](), NEVER))
    pairs = _aliased_pairs(compiled)
    n_grads, n_state = len(jax.tree.leaves(GRADS)), len(jax.tree.leaves(state))
    for i in range(n_state):
        assert pairs.get(n_grads + i) == n_grads + i, (i, pairs)


@COMPILED
def test_donating_only_the_state_pairs_updates_with_state_buffers():
    """Why a step that donates only the state copies it (docs/design.md,
    "Donating the state alone"): JAX pairs donated inputs with outputs by shape and
    dtype, in order, so the returned zero updates take the first
    params-shaped state buffers (Adam's `mu`) and those state leaves cannot
    be handed back in place. Donating the gradients too pairs every state
    leaf with itself (`test_donated_state_is_updated_in_place`)."""
    compiled, state = _compile(optax_ext.MultiSteps(optax.adam(1e-3), NEVER), (1,))
    pairs = _aliased_pairs(compiled)
    n_grads = len(jax.tree.leaves(GRADS))
    n_state = len(jax.tree.leaves(state))
    updates_from = sorted(pairs[i] for i in range(n_grads) if i in pairs)
    assert updates_from, pairs  # the updates took donated state buffers
    assert all(n_grads <= p < n_grads + n_state for p in updates_from)
    kept = [i for i in range(n_state) if pairs.get(n_grads + i) == n_grads + i]
    assert len(kept) < n_state  # so some state leaves are not kept in place


@COMPILED
@pytest.mark.parametrize("inner", INNER)
def test_temp_memory_at_most_optax(inner):
    """No more temporary memory than optax's MultiSteps, but for the
    conditional's buffer tables (`TABLES`; optax has no conditional). With jax 0.10
    adam, adafactor and lion need a few KiB against optax's one to three
    params-sized buffers. Muon (whose update transposes by copies) needs
    one params-sized buffer more than optax here, where the updates are the
    step's output: its updates leave the conditional in a buffer of their
    own (its train step: `test_compiled_backends.py`). Compiled sizes vary
    with the XLA version."""
    skip_cpu_memory_before_0_10_2()
    ours = _temp_bytes(optax_ext.MultiSteps(INNER[inner](), NEVER))
    theirs = _temp_bytes(optax.MultiSteps(INNER[inner](), NEVER))
    more = sum(p.nbytes for p in PARAMS.values()) if inner == "muon" else 0
    assert ours <= theirs + more + TABLES, (ours, theirs)


@COMPILED
def test_accumulation_is_one_fusion_per_leaf():
    """The mini-step's arithmetic, in ENTRY: per leaf one fused loop that
    accumulates (the reset is in the emitting branch)."""
    compiled, _ = _compile(optax_ext.MultiSteps(optax.adam(1e-3), NEVER))
    entry = hlo_computations(compiled.as_text())["ENTRY"]
    shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in PARAMS.values()}
    big = [
        line for line in entry
        if _opcode(line) == "fusion" and line.split(" = ")[1].split("{")[0] in shapes
    ]  # fmt: skip
    assert len(big) == len(PARAMS), big


@COMPILED
@pytest.mark.parametrize("inner", INNER)
def test_skip_when_without_flag_keeps_state_in_place(inner):
    """skip_when called without `skip` (flax's TrainState calls `update`
    so): the flag is known while tracing, so no conditional is built and
    the step is the bare inner optimizer's: no more arrays copied and no
    more temporary memory than `inner.update` + `apply_updates` alone
    (muon transposes by copies in its own update; constants are
    materialised by copies)."""
    bare = INNER[inner]()

    def compiled(tx, with_flag):
        def train_step(params, state, grads, skip):
            extra = {"skip": skip} if with_flag else {}
            updates, state = tx.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state

        fn = jax.jit(train_step, donate_argnums=(0, 1))
        return fn.lower(PARAMS, tx.init(PARAMS), GRADS, False).compile()

    def copies(compiled):
        instructions = [
            line.strip()
            for line in compiled.as_text().splitlines()
            if re.match(r"\s*(ROOT )?%\S+ = ", line)
        ]
        return [
            c
            for c in _array_copies(instructions)
            if "copy(%constant" not in c and _size(c) > 1
        ]

    without = compiled(optax_ext.skip_when(bare), False)
    reference = compiled(bare, False)
    assert "conditional(" not in without.as_text()
    assert len(copies(without)) <= len(copies(reference)), copies(without)
    temp = without.memory_analysis().temp_size_in_bytes
    assert temp <= reference.memory_analysis().temp_size_in_bytes


@COMPILED
@pytest.mark.parametrize("flag", ["absent", "python bool", "concrete array", "traced"])
def test_skip_when_flag_known_at_trace_time_leaves_no_conditional(flag):
    """A flag known at trace time (absent, a Python bool, an array closed
    over) indexes skip_when's conditional directly, and XLA inlines it: the
    compiled step of Adam (no state leaf ordered) holds no conditional. A
    traced flag keeps one, indexed by a test that XLA cannot fold (indexing
    the known flag that way too kept the conditional on every step)."""
    tx = optax_ext.skip_when(optax.adam(1e-3))
    known = {
        "absent": {},
        "python bool": {"skip": False},
        "concrete array": {"skip": jnp.asarray(False)},
    }

    def train_step(params, state, grads, skip):
        extra = known.get(flag, {"skip": skip})
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    fn = jax.jit(train_step, donate_argnums=(0, 1))
    compiled = fn.lower(PARAMS, tx.init(PARAMS), GRADS, jnp.asarray(False)).compile()
    assert _opcodes(compiled).count("conditional") == (flag == "traced")


@COMPILED
def test_skip_when_under_vmap_with_a_shared_flag_keeps_its_conditional():
    """vmap over a batch of models (params, state and grads batched) with
    one skip flag for the whole batch: the conditional stays one, so a
    skipped step runs no inner update. (Indexed by `traced_pred`, which tests an
    element of the batched state, it became a select that ran both
    branches.)"""
    tx = optax_ext.skip_when(optax.adam(1e-3))
    batch = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]), PARAMS)
    state = jax.vmap(tx.init)(batch)

    def train_step(params, state, grads, skip):
        updates, state = tx.update(grads, state, params, skip=skip)
        return optax.apply_updates(params, updates), state

    step = jax.vmap(train_step, in_axes=(0, 0, 0, None))
    compiled = jax.jit(step).lower(batch, state, batch, jnp.asarray(False)).compile()
    assert _opcodes(compiled).count("conditional") == 1


@COMPILED
def test_multi_steps_under_vmap_with_shared_counters_keeps_its_conditional():
    """vmap over a batch of models whose MultiSteps counters are shared (the
    counters mapped with `None`, the accumulator and Adam's moments
    batched): the window's conditional stays one, so a mini-step runs no
    inner update, and the batch's updates are each model's own (against
    the models run one by one). (Indexed by `traced_pred`, which tests an
    element of the batched state, it became a select.)"""
    tx = optax_ext.MultiSteps(optax.adam(1e-3), 3)
    batch = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]), PARAMS)
    one = tx.init(PARAMS)
    state = one._replace(
        acc_grads=jax.tree.map(lambda x: jnp.stack([x, x]), one.acc_grads),
        inner_opt_state=jax.tree.map(lambda x: jnp.stack([x, x]), one.inner_opt_state),
    )
    axes = optax.MultiStepsState(
        mini_step=None,
        gradient_step=None,
        inner_opt_state=0,
        acc_grads=0,
        skip_state=None,
    )

    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(train_step, in_axes=(0, axes, 0), out_axes=(0, axes)))
    compiled = step.lower(batch, state, batch).compile()
    assert _opcodes(compiled).count("conditional") >= 1
    params, grads = batch, jax.tree.map(lambda x: 0.5 * x, batch)
    own = [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(2)]
    own_states = [tx.init(p) for p in own]
    one_step = jax.jit(train_step)
    for _ in range(3):
        params, state = step(params, state, grads)
        for i in range(2):
            g = jax.tree.map(lambda x, i=i: x[i], grads)
            own[i], own_states[i] = one_step(own[i], own_states[i], g)
    for i in range(2):
        for got, want in zip(
            jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], params)),
            jax.tree.leaves(own[i]),
            strict=True,
        ):
            assert jnp.array_equal(got, want)


# What each mechanism adds to the program XLA:CPU is given for Lion's drop-in
# `update` (the updates read the state's `mu` before it is written; `w` has
# 2**16 elements, so its zeros are its own): (barriers, multiplies, selects)
# that switching it off removes.
MECHANISM_OPS = {
    "scalar_barrier": (1, 0, 0),
    "distinct_zeros": (0, 1, 0),
    "state_after_updates": (2, 0, 2),
}


@COMPILED
@pytest.mark.parametrize("mechanism", MECHANISM_OPS)
def test_each_mechanism_switch_removes_its_mechanism_and_no_other(mechanism):
    """`xla.configured(opt, <mechanism>=False)` (the switch the benchmarks and
    docs/design.md's measurements use) takes exactly that mechanism's ops out
    of the lowered program; a switch that did nothing would measure nothing."""
    from optax_ext._accumulate import xla

    params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}
    grads = jax.tree.map(jnp.ones_like, params)

    def ops(opt):
        step = jax.jit(lambda g, s: opt.update(g, s, params))
        text = step.lower(grads, opt.init(params)).as_text()
        kinds = ("optimization_barrier", "multiply", "select")
        return [text.count(f"stablehlo.{kind} ") for kind in kinds]

    opt = optax_ext.MultiSteps(optax.lion(1e-4), 3)
    on, off = ops(opt), ops(xla.configured(opt, **{mechanism: False}))
    removed = tuple(a - b for a, b in zip(on, off, strict=True))
    assert removed == MECHANISM_OPS[mechanism], (on, off)
