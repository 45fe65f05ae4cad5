"""docs/check_your_step.md runs: its ```python blocks, executed in page
order in one namespace, compile a train step for an H200 and a TPU v5e
without either, compare its memory with `optax.MultiSteps`' and estimate
each form's device time from the same compiles (`benchmarks/step_cost.py`).

It needs the deviceless environment (`tests/_compiled.py`): elsewhere it
skips, saying how to build it. `test_deviceless_runner.py` runs it there,
and there a missing compiler fails it.
"""

import pathlib
import re

import pytest
from _compiled import HERE, opcode, unavailable
from _helpers import hlo_computations

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "check_your_step.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line, source) of each ```python block of a Markdown page."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)
    ]


def test_page_has_the_recipe_s_blocks():
    """The recipe's steps are code a reader runs, whatever the environment."""
    sources = [source for _, source in python_blocks(PAGE.read_text())]
    assert len(sources) >= 4
    assert 'os.environ["JAX_PLATFORMS"] = "cpu"' in sources[0]
    assert sources[0].index("JAX_PLATFORMS") < sources[0].index("import jax")
    joined = "\n".join(sources)
    for needed in (
        "h200_target.txtpb",
        "v5e:1x1",
        "optax.MultiSteps",
        "donate_argnums",
        "step_cost.window_cost",
        "emitting_step=",
    ):
        assert needed in joined, needed


def test_gpu_and_tpu_recipe_of_the_check_your_step_page_runs(monkeypatch):
    """Named for the deviceless runner's `-k "gpu or tpu ..."` filter."""
    why = unavailable("gpu") or unavailable("tpu")
    if why:
        if HERE:
            pytest.fail(f"the page's GPU and TPU compiles must run here: {why}")
        pytest.skip(why)
    monkeypatch.chdir(ROOT)  # the page reads tests/data/h200_target.txtpb
    namespace = {"__name__": "check_your_step"}
    for line, source in python_blocks(PAGE.read_text()):
        try:
            exec(compile(source, f"{PAGE}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(
                f"the block at docs/check_your_step.md:{line} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
    assert len(namespace["memory"]) == 6
    _check_the_estimate(namespace)


def _check_the_estimate(namespace):
    """The page's estimate counts what its compiles run, as `step_cost`
    documents: a window of 4 is 3 mini-steps and 1 emitting step, each
    kernel is launched once at `LAUNCH_US` on the H200 (no launch term on
    the v5e), and a conditional costs its cheaper branch on a mini-step,
    its dearer one on the emitting step (plus 1 launch: its predicate)."""
    step_cost, costs = namespace["step_cost"], namespace["costs"]
    assert list(costs["H200"]) == ["optax.MultiSteps", "drop-in", "fused", "emit="]
    assert list(costs["TPU v5e"]) == ["optax.MultiSteps", "drop-in", "fused"]
    for target, forms in costs.items():
        for cost in forms.values():
            assert cost.kernels == 3 * cost.mini.kernels + cost.emitting.kernels
            per_launch = step_cost.LAUNCH_US * 1e-6 if target == "H200" else 0.0
            assert cost.launch_cost == cost.kernels * per_launch
    # XLA:GPU turns optax.MultiSteps' `lax.cond` into selects: every step
    # runs the same kernels. optax_ext's fused step keeps a conditional.
    h200 = costs["H200"]
    assert h200["optax.MultiSteps"].mini == h200["optax.MultiSteps"].emitting
    text = namespace["compiled"]["H200", "fused"].as_text()
    comps = hlo_computations(text)
    (conditional,) = [
        line for lines in comps.values() for line in lines if " conditional(" in line
    ]
    branches = re.findall(r"(?:true|false)_computation=%([\w.\-]+)", conditional)
    kernels = sorted(
        sum(opcode(line) not in step_cost.FREE for line in comps[b]) for b in branches
    )
    fused = h200["fused"]
    assert fused.emitting.kernels - fused.mini.kernels == kernels[1] - kernels[0]
    assert fused.mini.cost < fused.emitting.cost
