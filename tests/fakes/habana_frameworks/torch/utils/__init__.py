"""TEST DOUBLE of ``habana_frameworks.torch.utils`` (``internal``, and the slice of ``experimental`` DeepSpeed calls)."""
