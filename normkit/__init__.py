"""normkit: LayerNorm, RMSNorm (and friends) kernels for PyTorch at the speed of light of memory."""
from . import reference
from .backends import BackendUnavailableError
from .functional import layer_norm, layer_norm_bwd, layer_norm_fwd, rms_norm, rms_norm_bwd, rms_norm_fwd
from .modules import LayerNorm, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "layer_norm",
    "rms_norm",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "LayerNorm",
    "RMSNorm",
    "BackendUnavailableError",
    "reference",
]
