"""`benchmarks/step_cost.py` counts and costs what a compiled program runs
as its docstring says, on a small HLO module written out here (no compile,
any JAX): each instruction that is not free launches one kernel, a
conditional one more; a mini-step runs each conditional's cheaper branch
and the emitting step its dearer one; a window of k is k - 1 mini-steps
and 1 emitting step; launches cost `launch_us` each on the H200 only. The
page that runs it on real compiles: `test_check_your_step_doc.py`."""

import pytest

from benchmarks import step_cost

# An entry computation of one kernel, then a conditional whose branches
# run 1 kernel (a copy) and 2 (two fusions). On the TPU v5e the copy has no
# `estimated_cycles`.
HLO = """HloModule m

%add (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %y = f32[1024]{0} add(%x, %x)
}

%idle (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %c = f32[1024]{0} copy(%p)
}

%run (q: f32[1024]) -> f32[1024] {
  %q = f32[1024]{0} parameter(0)
  %a = f32[1024]{0} fusion(%q), kind=kLoop, calls=%add, backend_config={"estimated_cycles":"30"}
  ROOT %b = f32[1024]{0} fusion(%a), kind=kLoop, calls=%add, backend_config={"estimated_cycles":"50"}
}

ENTRY %main (e: f32[1024], k: pred[]) -> f32[1024] {
  %e = f32[1024]{0} parameter(0)
  %k = pred[] parameter(1)
  %g = f32[1024]{0} fusion(%e), kind=kLoop, calls=%add, backend_config={"estimated_cycles":"100"}
  ROOT %r = f32[1024]{0} conditional(%k, %g, %g), true_computation=%run, false_computation=%idle
}
"""  # noqa: E501
KERNEL_BYTES = 2 * 4096  # each kernel reads one f32[1024] and writes one


def test_a_mini_step_runs_the_cheaper_branch_and_the_emitting_step_the_dearer():
    mini = step_cost.program_cost(HLO, "H200", min)
    emitting = step_cost.program_cost(HLO, "H200", max)
    # The entry's fusion, the conditional's predicate, then the branch.
    assert (mini.kernels, emitting.kernels) == (1 + 1 + 1, 1 + 1 + 2)
    assert (mini.bytes, emitting.bytes) == (2 * KERNEL_BYTES, 3 * KERNEL_BYTES)
    assert mini.cost == pytest.approx(2 * KERNEL_BYTES / step_cost.H200_BYTES_PER_S)
    assert mini.flops == emitting.flops == 0


@pytest.mark.parametrize("launch_us", [step_cost.LAUNCH_US, 3.0])
@pytest.mark.parametrize("window", [1, 4])
def test_the_launch_term_is_the_window_s_kernels_times_the_cost_of_one(
    window, launch_us
):
    cost = step_cost.window_cost(HLO, "H200", window=window, launch_us=launch_us)
    assert cost.kernels == (window - 1) * 3 + 4
    assert cost.launch_cost == cost.kernels * launch_us * 1e-6
    assert cost.with_launches == cost.cost + cost.launch_cost
    assert cost.cost == pytest.approx(
        ((window - 1) * 2 + 3) * KERNEL_BYTES / step_cost.H200_BYTES_PER_S
    )


def test_a_separate_emitting_program_ends_the_window():
    """`emit=`: the host's `emit=False` program, then its `emit=True` one."""
    idle = HLO.replace("%run,", "%idle,")  # both branches the copy
    cost = step_cost.window_cost(idle, "H200", window=4, emitting=HLO)
    assert (cost.mini.kernels, cost.emitting.kernels, cost.kernels) == (3, 4, 13)


def test_the_tpu_sums_estimated_cycles_and_adds_no_launches():
    cost = step_cost.window_cost(HLO, "TPU v5e", window=4)
    # The idle branch's copy has no estimated cycles: it counts 0, and as
    # uncosted in the program's every branch.
    assert (cost.mini.cost, cost.emitting.cost) == (100, 100 + 30 + 50)
    assert (cost.mini.uncosted, cost.emitting.uncosted) == (1, 1)
    assert cost.cost == 3 * 100 + 180
    assert cost.launch_cost == 0.0


def test_the_command_line_prints_each_form_s_window(tmp_path, capsys):
    (tmp_path / "a.hlo").write_text(HLO)
    step_cost.main(["--target", "H200", f"fused={tmp_path / 'a.hlo'}"])
    header, _, row = capsys.readouterr().out.splitlines()
    assert "kernels: mini-step, emitting" in header
    assert row.startswith("| fused | 3, 4 | ")


def test_an_unknown_target_says_which_there_are():
    with pytest.raises(ValueError, match="'H200' or 'TPU v5e'"):
        step_cost.program_cost(HLO, "H100")


# A loop of 4 trips around one fusion (as `microbatched`'s loop over its
# micro-batches), its trip count written by XLA (XLA:CPU, XLA:GPU) or only
# in its condition, a counter from 0 below 4 (XLA:TPU).
LOOP = """HloModule m

%add (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %y = f32[1024]{0} add(%x, %x)
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[1024]{0} get-tuple-element(%t), index=1
  %f = f32[1024]{0} fusion(%v), kind=kLoop, calls=%add, backend_config={"estimated_cycles":"10"}
  ROOT %n = (s32[], f32[1024]{0}) tuple(%i, %f)
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %c = (s32[], f32[1024]{0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main (e: f32[1024]) -> (s32[], f32[1024]) {
  %e = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %e)
  ROOT %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body{KNOWN}
}
"""  # noqa: E501


@pytest.mark.parametrize(
    "known", [', backend_config={"known_trip_count":{"n":"4"}}', ""]
)
def test_a_loop_s_body_counts_once_per_trip(known):
    program = LOOP.replace("{KNOWN}", known)
    assert step_cost.program_cost(program, "TPU v5e", min).cost == 4 * 10
    gpu = step_cost.program_cost(program, "H200", min)
    assert gpu.kernels == 4 and gpu.bytes == 4 * KERNEL_BYTES
