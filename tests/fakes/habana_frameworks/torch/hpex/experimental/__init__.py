"""TEST DOUBLE of ``habana_frameworks.torch.hpex.experimental`` (bridge 1.19.0): a package holding
``transformer_engine``."""
