"""`benchmarks/gpu_check.py` runs where no GPU is: its `--quick` smoke run
on one scaled-down case, so that a GPU, when one is lent for a few
minutes, is not spent finding a broken script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.xdist_group("gpu_check")
def test_quick_run_times_every_candidate_and_writes_its_report(tmp_path):
    """One case, every candidate and floor timed both ways (inside one
    `lax.scan`, and in a host loop) for a mini-step, an emitting step and a
    window; the cases not selected are reported as not run; the report is
    written as Markdown and JSON."""
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--quick",
            "--case",
            "large:float32",
            "--steps",
            "4",
            "--rounds",
            "1",
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
    data = json.loads(report.read_text())
    assert report.with_suffix(".md").exists()
    cases = data["bench"]["cases"]
    ran = {k: v for k, v in cases.items() if "skipped" not in v}
    assert list(ran) == ["8 x (256, 256), float32"], cases
    assert all("not selected" in v["skipped"] for k, v in cases.items() if k not in ran)
    ms = ran["8 x (256, 256), float32"]["ms"]
    assert set(ms) == {"mini", "emit", "window"}, ms
    floors = ("accumulate", "accumulate+state", "drop-in floor")
    for step, by_candidate in ms.items():
        timed = ("optax", "ext", "ext fused", "host-chosen", "plain", "plain fused")
        for candidate in timed + (floors if step == "mini" else ()):
            times = by_candidate[candidate]
            assert set(times) == {"scan", "host"}, (step, candidate, times)
            assert all(t > 0 for t in times.values()), (step, candidate, times)
