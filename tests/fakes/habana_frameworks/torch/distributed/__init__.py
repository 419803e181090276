"""TEST DOUBLE of ``habana_frameworks.torch.distributed`` (only the ``hccl`` registration)."""
