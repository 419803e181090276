"""TEST DOUBLE of ``habana_frameworks.torch.hpex`` (``optimizers.FusedAdamW``, ``normalization.FusedClipNorm`` and ``FusedRMSNorm``, ``kernels.FusedSDPA`` and the rotary helpers)."""
