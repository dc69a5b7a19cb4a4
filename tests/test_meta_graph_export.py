"""A meta graph exported after EPL's rewrite is the graph that runs: every copy the
rewrite made is in it, and it imports.

``export_meta_graph(clear_devices=True)`` (or with an export scope) walks the Python
graph's own table of ops, where the copies EPL makes through TensorFlow's C API appear
only once wrapped (``tf_adapter.deferred``); measured before the hook: a 2-stage
pipeline of the corpus mini-BERT exported 2,635 of its 4,933 nodes, its all-reduce ops
still reading micro-batch clones left out, and the meta graph did not import."""
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import rewrite
from tests import auto_models


@pytest.mark.parametrize("clear_devices", [True, False])
def test_a_rewritten_pipelines_meta_graph_holds_every_op_and_imports(clear_devices):
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "auto.auto_parallel": True,
                         "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2}))
    graph = tf.get_default_graph()
    features = tf.data.make_one_shot_iterator(auto_models.dataset()).get_next()
    loss = auto_models.model(features)
    auto_models.optimizer().minimize(loss, global_step=tf.train.get_or_create_global_step())
    rewrite.rewrite_if_needed(graph)
    meta = tf.train.export_meta_graph(graph=graph, clear_devices=clear_devices)
    names = set(node.name for node in meta.graph_def.node)
    assert names == set(op.name for op in graph.get_operations())
    assert any(name.startswith("EPL_") for name in names)      # the rewrite's copies
    dangling = [(node.name, i) for node in meta.graph_def.node for i in node.input
                if i.lstrip("^").split(":")[0] not in names]
    assert not dangling
    with tf.Graph().as_default() as fresh:
        tf.train.import_meta_graph(meta)        # (adds a Saver's ops of its own)
        assert names <= set(op.name for op in fresh.get_operations())
