"""TEST DOUBLE of ``habana_frameworks.torch.hpex`` (only ``optimizers.FusedAdamW`` and ``normalization.FusedClipNorm``)."""
