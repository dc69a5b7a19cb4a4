"""Tensor model parallelism: what ``epl.split(n)`` builds.

Ops under ``split(n)`` are built sharded while the user's graph is built: the
user's ordinary calls (``tf.layers.dense``, ``tf.keras.layers.Dense``,
``tf.nn.sparse_softmax_cross_entropy_with_logits`` / ``tf.losses...``,
``tf.argmax``) are routed here by :mod:`epl.capture.tensor_parallel_routing` and make one shard per
device, each op tagged with its shard (``epl.ir``).  TensorFlow's own autodiff
then builds the sharded backward pass; the rewriter only places shard ``i`` on
the split's device ``i`` and bridges replicated TaskGraphs to the split one
(:mod:`epl.rewrite.split`).

Modules: ``sharding`` (shard context, sizes, the logical-tensor registry),
``layers`` (dense), ``losses`` (softmax cross-entropy, argmax), ``moe``
(mixture of experts with all-to-all), ``propagation`` and ``rules`` (ops on a
sharded tensor kept sharded shard by shard: head-parallel attention; called from
the graph's op-creation hook, ``epl.capture.ops``).

Capture layer (4), beside ``capture`` and ``features``.
"""
