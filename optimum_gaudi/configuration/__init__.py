"""What a user declares: the JSON ``GaudiConfig``, its autocast op lists and their aten vocabulary, and where a
config named on the Hub comes from. Plain data and checks: imports only ``errors``."""

from .._legacy_paths import forward_moved_names
from .gaudi_config import GaudiConfig, GaudiConfigError

__all__ = ["GaudiConfig", "GaudiConfigError"]

__getattr__ = forward_moved_names(__name__, "optimum_gaudi.configuration.gaudi_config")  # the 0.1 module's names
