"""Optax gradient transformations that keep working when composed."""

from ._accumulate.accumulations import (
    WeightedMultiStepsState as WeightedMultiStepsState,
)
from ._accumulate.accumulations import gradient_noise_scale as gradient_noise_scale
from ._apply import apply_gradients as apply_gradients
from ._inject import inject_hyperparams as inject_hyperparams
from ._linen import train_state_apply_gradients as train_state_apply_gradients
from ._microbatched import microbatched as microbatched
from ._multi_steps import MultiSteps as MultiSteps
from ._nnx import nnx_apply_gradients as nnx_apply_gradients
from ._skip_when import skip_when as skip_when
from ._stop_gradient import stop_gradient_where as stop_gradient_where
from ._zero_nans import zero_nans as zero_nans

__version__ = "0.1.0"

__all__ = [
    "MultiSteps",
    "WeightedMultiStepsState",
    "apply_gradients",
    "gradient_noise_scale",
    "inject_hyperparams",
    "microbatched",
    "nnx_apply_gradients",
    "skip_when",
    "stop_gradient_where",
    "train_state_apply_gradients",
    "zero_nans",
]
