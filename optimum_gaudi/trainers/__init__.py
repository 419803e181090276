"""The trainers users build: the Gaudi mixins for ``Trainer`` and ``TrainingArguments`` and the classes made
of them (GaudiTrainer, Seq2Seq, TRL), with the loop events and the shims for older transformers releases.

The top layer: it may import every other folder; nothing below imports it.
"""
