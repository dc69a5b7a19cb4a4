"""Capture (layer 4): how EPL learns, while the user builds the graph, what each op is.

``patches`` lists the hooks on TensorFlow's entry points and installs them; ``ops``
records every new op in the IR (TaskGraph, phase, shard); ``backward`` captures a
user's backward pass and ``apply`` a user's ``apply_gradients``, each running the
features registered on its registry (``backward_hooks``, ``apply_hooks``, ordered by
``hook_order``); ``tensor_parallel_routing`` sends calls under ``epl.split`` to
``epl.tensor_parallel``; ``savers``, ``keras_reports``, ``readers`` and ``rebatch``
adjust what a user's program saves and sees (EPL's own state, Keras metrics, file
readers, batch shapes).  May import ``ir``,
``core``, ``communicators`` and the adapter; the features and tensor parallelism
(the same layer) plug into its registries.
"""
