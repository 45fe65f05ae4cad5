"""docs/check_your_step.md runs: its ```python blocks, executed in page
order in one namespace, compile a train step for an H200 and a TPU v5e
without either and compare its memory with `optax.MultiSteps`'.

It needs the deviceless environment (`tests/_compiled.py`): elsewhere it
skips, saying how to build it. `test_deviceless_runner.py` runs it there,
and there a missing compiler fails it.
"""

import pathlib
import re

import pytest
from _compiled import HERE, unavailable

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
