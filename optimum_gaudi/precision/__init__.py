"""Precision, in one room: the autocast op lists (Habana's defaults, the aten vocabulary, the bridge's list
files), the op-list autocast CPU and CUDA run, the check that op lists do not mix dtypes in one op, the fp8 recipe,
the fp8 contract each device fulfils (``Fp8Plan``) with the layers it converts and the scaling state a checkpoint
keeps.

It knows no device and no Gaudi config class: the trainer hands it both. So the lower layers (configuration, the
devices, the launcher) can use the op lists and the fp8 contract without a circle; imports only ``errors``.
"""

from .._legacy_paths import forward_moved_names

# optimum_gaudi.precision was the op-list autocast's module in 0.1: its names, after one FutureWarning
__getattr__ = forward_moved_names(__name__, "optimum_gaudi.precision.autocast")
