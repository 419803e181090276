"""TEST DOUBLE of ``habana_frameworks.torch.dynamo``: the package; the torch.compile backend lives in
``compile_backend``, which ``core`` imports only in eager mode (``core/__init__.py``)."""
