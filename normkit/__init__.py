"""normkit: LayerNorm, RMSNorm and GroupNorm kernels for PyTorch at the speed of light of memory."""
from . import reference
from .backends import BackendUnavailableError
from .compile_fusion import enable_compile_fusion
from .functional import (group_norm, layer_norm, layer_norm_bwd, layer_norm_fwd, rms_norm, rms_norm_bwd,
                         rms_norm_fwd)
from .modules import GroupNorm, LayerNorm, RMSNorm
from .patch import patch, unpatch  # noqa: E402  (the functions shadow the submodule's name)
from . import blocks as _blocks  # noqa: E402,F401  (registers the block fusions that patch() applies)

__version__ = "0.1.0"

__all__ = [
    "layer_norm",
    "rms_norm",
    "group_norm",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "BackendUnavailableError",
    "patch",
    "unpatch",
    "enable_compile_fusion",
    "reference",
]
