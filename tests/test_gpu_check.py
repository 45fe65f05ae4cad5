"""`benchmarks/gpu_check.py` runs where no GPU is: its `--quick` smoke run
(one case on tiny shapes, every step and table of a full run), so that a GPU,
when one is lent for a few minutes, is not spent finding a broken script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("optax", "ext", "ext fused", "host-chosen", "plain", "plain fused")
FLOORS = ("accumulate", "accumulate+state", "updates floor")


@pytest.mark.xdist_group("gpu_check")
def test_quick_run_times_and_sizes_every_step_and_writes_its_report(tmp_path):
    """One case: every step and floor timed both ways (inside one `lax.scan`,
    and in a host loop) as a mini-step, an emitting step and a window, and
    the temporary memory of each compiled step; the other cases reported as
    not run; the whole train step (loss and `jax.grad` inside) of each form
    timed over windows and sized; the report written as Markdown, its
    tables titled by what they measure, and as JSON."""
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--quick",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (report,) = tmp_path.glob("*.json")
    cases = json.loads(report.read_text())["bench"]["cases"]
    ran = {k: v for k, v in cases.items() if "skipped" not in v}
    assert list(ran) == ["8 x (128, 128), scaled down, float32"], cases
    assert all("not selected" in v["skipped"] for k, v in cases.items() if k not in ran)
    (case,) = ran.values()
    assert set(case["ms"]) == {"mini", "emit", "window"}, case["ms"]
    for mode, by_step in case["ms"].items():
        for step in STEPS + (FLOORS if mode == "mini" else ()):
            times = by_step[step]
            assert set(times) == {"scan", "host"}, (mode, step, times)
            assert all(t > 0 for t in times.values()), (mode, step, times)
    assert set(case["temp_mib"]) == set(STEPS + FLOORS), case["temp_mib"]
    assert all(mib >= 0 for mib in case["temp_mib"].values()), case["temp_mib"]
    text = report.with_suffix(".md").read_text()
    for title in (
        "Time per mini-step:",
        "Time per emitting step:",
        "Time per step over a window of 4:",
        "Temporary memory of each step against optax.MultiSteps:",
        "## Whole train step",
    ):
        assert title in text, title
    (whole,) = json.loads(report.read_text())["whole_step"]["cases"].items()
    assert whole[0] == "MLP of 2 x (128, 128), scaled down, batch 8, float32"
    forms = ("bare", "optax", "drop-in", "fused", "host-chosen")
    for key in ("ms", "temp_mib", "peak_mib"):
        assert tuple(whole[1][key]) == forms, (key, whole[1][key])
    assert all(t > 0 for t in whole[1]["ms"].values()), whole[1]["ms"]
    for form in forms:
        assert whole[1]["peak_mib"][form] > whole[1]["temp_mib"][form] >= 0, form
    assert "issue" not in text.lower()
