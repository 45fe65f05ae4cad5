"""The drop-in's and the fused mini-step's time against the plain
`lax.cond` MultiSteps of `_steps.plain_multi_steps` and optax.MultiSteps,
alone: five candidates of `benchmarks/train_step.py`, timed round-robin over many
rounds, for a steadier ratio than the whole table gives on a shared
machine.

Run with `python benchmarks/investigations/mini_step_speed.py [ROUNDS] [INNER] [LAYOUT]`
(default 60 rounds of Adam on 96 x (64, 64) float32 leaves); prints the
median ratios and the spread over four quarters of the rounds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import machine, time_interleaved  # noqa: E402
from train_step import LAYOUTS, Runner, params_and_grads, steps  # noqa: E402

NAMES = ["ext", "plain", "optax", "ext fused", "plain fused"]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    inner = sys.argv[2] if len(sys.argv) > 2 else "adam"
    layout = sys.argv[3] if len(sys.argv) > 3 else "96 x (64, 64)"
    n, shape = LAYOUTS[layout]
    params, grads = params_and_grads({f"w{i:03d}": shape for i in range(n)}, "float32")
    candidates = steps(inner, emit=False)
    runners = {name: Runner(*candidates[name], params, grads, (0, 1)) for name in NAMES}
    time_interleaved(list(runners.values()), rounds)
    print(f"{machine()}; {inner}, {layout}, float32, {rounds} rounds (mini-steps)")
    quarter = rounds // 4

    def ratio(a, b, part=slice(None)):
        return statistics.median(runners[a].times[part]) / statistics.median(
            runners[b].times[part]
        )

    for a, b in [("ext", "plain"), ("ext fused", "plain fused"), ("ext", "optax")]:
        parts = [ratio(a, b, slice(i * quarter, (i + 1) * quarter)) for i in range(4)]
        print(
            f"{a} / {b}: {ratio(a, b):.2f} (quarters "
            + ", ".join(f"{p:.2f}" for p in parts)
            + ")"
        )


if __name__ == "__main__":
    main()
