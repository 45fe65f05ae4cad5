"""`bytes_model.py` of the project's GPU notes (outside this repository,
`OPTAX_EXT_BYTES_MODEL`, default `/work/shared/gpu/bytes_model.py`), with
optax_ext's MultiSteps accumulating in the gradients' dtype
(`accumulator_dtype=None`); optax.MultiSteps keeps its default float32
accumulator (its `accumulator_dtype=None` raises with bfloat16 params).

    PYTHONPATH=. .venv-deviceless/bin/python benchmarks/bytes_model_accumulator.py \
        --case gpt2bf16 --inner adamw
"""

import os
import runpy
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax_ext  # noqa: E402

_init = optax_ext.MultiSteps.__init__


def _gradients_dtype_accumulator(self, *args, **kwargs):
    kwargs.setdefault("accumulator_dtype", None)
    _init(self, *args, **kwargs)


optax_ext.MultiSteps.__init__ = _gradients_dtype_accumulator
MODEL = os.environ.get("OPTAX_EXT_BYTES_MODEL", "/work/shared/gpu/bytes_model.py")
sys.argv = [MODEL, *sys.argv[1:]]
runpy.run_path(MODEL, run_name="__main__")
