"""What a user declares: the JSON ``GaudiConfig`` and where a config named on the Hub comes from. Plain data and
checks: imports ``errors`` and the op lists (``precision/op_lists.py``) it hands to the bridge."""

from .._legacy_paths import forward_moved_names
from .gaudi_config import GaudiConfig, GaudiConfigError

__all__ = ["GaudiConfig", "GaudiConfigError"]

__getattr__ = forward_moved_names(__name__, "optimum_gaudi.configuration.gaudi_config")  # the 0.1 module's names
