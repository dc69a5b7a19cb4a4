"""Features (layer 4, beside capture): the optional changes to a user's training step.

Mixed precision (``amp``), gradient checkpointing (``gradient_checkpoint``), gradient
accumulation across runs (``accumulate``), an update gated by a predicate
(``apply_gate``), grouped apply (``grouped_apply``), sparse gradients made dense for
the optimizer (``sparse_as_dense``) and automatic pipeline stages (``auto_stages``).
Each registers on capture's backward-pass or apply-path registry when imported
(``epl.api`` imports them all).  May import ``capture`` and the layers below it.
"""
