"""Multi-card training: the fast_ddp gradient all-reduce and the multi-process launcher."""
