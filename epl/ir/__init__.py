"""The intermediate representation (layer 2): what capture records about a ``tf.Graph``.

``graph`` holds ``ir.Graph`` (TaskGraphs, each op's phase and shard, the gradient and
apply records) and the graph walks every pass uses; the package re-exports them, so
``from epl import ir; ir.Graph`` is the IR.  Beside it: the strategy annotations
(``strategies``), which variable an op writes (``variable_writes``), EPL's own variables
(``internal_state``), the thread's capture flags (``capture_context``), ``epl.GraphKeys``
(``graph_keys``) and the peak bytes of a traced run (``memory_trace``).  May import
``core`` and the adapter.
"""
from epl.ir.graph import (APPLY, BACKWARD, FORWARD, REWRITE, SAVE, SOURCE_OPS,  # noqa: F401
                          ApplyRecord, Graph, GradientRecord, RewriteLifecycle, TaskGraph,
                          TensorMap, components, downstream, is_batch_placeholder,
                          is_batch_source, is_state_handle, ops_since, separators, upstream,
                          variable_bytes, variables_by_device)
