"""The machinery the trainer mixin switches on, device-independent: compilation, static batches, graphs,
profiling, throughput metrics and the feature table. Each asks the device object for the device-specific part;
may import devices, configuration and errors, never the trainers."""

from .table import feature_table

__all__ = ["feature_table"]
