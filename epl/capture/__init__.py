"""Capture (layer 4): how EPL learns, while the user builds the graph, what each op is.

``patches`` installs the hooks on TensorFlow's entry points and records every new op
in the IR; ``backward_hooks`` is the registry of features that change a user's
backward pass; ``keras_reports``, ``readers`` and ``rebatch`` adjust what a user's
program sees (Keras metrics, file readers, batch shapes).  May import ``ir``,
``core``, ``communicators`` and the adapter; the features and tensor parallelism
(the same layer) plug into its registries.
"""
