"""`bytes_model.py` of the project's GPU notes (outside this repository: its
path is `--model PATH` or `OPTAX_EXT_BYTES_MODEL`), with optax_ext's
MultiSteps accumulating in the gradients' dtype (`accumulator_dtype=None`);
optax.MultiSteps keeps its default float32 accumulator (its
`accumulator_dtype=None` raises with bfloat16 params). The other arguments
go to `bytes_model.py`.

    PYTHONPATH=. .venv-deviceless/bin/python \
        benchmarks/investigations/bytes_model_accumulator.py \
        --model PATH/TO/bytes_model.py --case gpt2bf16 --inner adamw

Its figures are in `benchmarks/results/gpu_estimate.md`.
"""

import argparse
import os
import runpy
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax_ext  # noqa: E402

_init = optax_ext.MultiSteps.__init__


def _gradients_dtype_accumulator(self, *args, **kwargs):
    kwargs.setdefault("accumulator_dtype", None)
    _init(self, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("OPTAX_EXT_BYTES_MODEL"),
        help="path of bytes_model.py (default: $OPTAX_EXT_BYTES_MODEL)",
    )
    args, rest = parser.parse_known_args()
    if not args.model:
        parser.error("give --model PATH or set OPTAX_EXT_BYTES_MODEL")
    optax_ext.MultiSteps.__init__ = _gradients_dtype_accumulator
    sys.argv = [args.model, *rest]
    runpy.run_path(args.model, run_name="__main__")


if __name__ == "__main__":
    main()
