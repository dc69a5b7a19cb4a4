"""The rewrite's pass driver (epl/rewrite/pipeline.py): contracts checked when the
pipeline is built, every pass timed, the graph dumped after each pass on request, and
the default pipeline's passes doing what their contracts say on a small DP program."""
import os

import pytest
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import graph_pb2
from google.protobuf import text_format

from epl.rewrite import PASSES
from epl.rewrite.pipeline import Pass, PassContext, PassOrderError, PassPipeline
from tests import models


def _noop(_):
    return None


def test_a_pass_before_what_it_requires_is_refused():
    with pytest.raises(PassOrderError, match="'join' requires \\['cloned'\\]"):
        PassPipeline([Pass("join", _noop, requires={"cloned"}),
                      Pass("clone", _noop, provides={"cloned"})])
    with pytest.raises(PassOrderError, match="appears twice"):
        PassPipeline([Pass("a", _noop), Pass("a", _noop)])
    PassPipeline([Pass("clone", _noop, provides={"cloned"}),
                  Pass("join", _noop, requires={"cloned"})])


def test_first_only_passes_skip_later_rewrites_and_every_pass_is_timed():
    ran = []
    pipe = PassPipeline([Pass("a", lambda c: ran.append("a")),
                         Pass("b", lambda c: ran.append("b"), first_only=True)])
    seconds = pipe.run(PassContext(None, None, -1, first=False), dump_dir="")
    assert ran == ["a"] and set(seconds) == {"a"}
    pipe.run(PassContext(None, None, -1, first=True), dump_dir="")
    assert ran == ["a", "a", "b"] and set(pipe.seconds) == {"a", "b"}


def test_the_default_order_holds_its_contracts():
    # Built at import; rebuilding it checks every requires against the passes before it.
    rebuilt = PassPipeline(PASSES.passes)
    assert rebuilt.names()[:4] == ["place_originals", "reinstall", "shard_inputs",
                                   "clone_replicas"]
    clone = rebuilt.names().index("clone_replicas")
    for later in ("bridge_split", "schedule_pipeline", "join_clones", "merge_outputs"):
        assert rebuilt.names().index(later) > clone


def _dumped(folder, name):
    gd = graph_pb2.GraphDef()
    text_format.Merge(open(os.path.join(folder, name)).read(), gd)
    return {n.name: n for n in gd.node}


def test_dump_after_each_pass_shows_what_each_pass_did(tmp_path, monkeypatch):
    """On DP x2: after place_originals replica 0's MatMul sits on device 0 and no copy
    exists; after clone_replicas replica 1's copy exists on device 1 and the gradients
    are all-reduced; the numbers equal the program without EPL."""
    monkeypatch.setenv("EPL_DUMP_PASSES", str(tmp_path))
    x, y = models.data(32)
    want, _ = models.train_local(x, y, 16, 2, "sgd")
    models.reset()
    models.init_data_parallel(2)
    bx, by = models.input_batch(x, y, 8)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "sgd", tf.train.get_or_create_global_step())
    got = models.run_steps(op, 2, [models.value_tensor(tf.get_default_graph(), n)
                                   for n in sorted(models.initial_weights())])
    models.assert_weights_close(dict(zip(sorted(models.initial_weights()), got)), want)
    files = sorted(os.listdir(str(tmp_path)))
    assert [f.split("_", 1)[1][:-len(".pbtxt")] for f in files] == PASSES.names()
    placed = _dumped(str(tmp_path), files[0])
    cloned = _dumped(str(tmp_path), files[PASSES.names().index("clone_replicas")])
    assert placed["dense/MatMul"].device.endswith("CPU:0")
    copies = [n for n in cloned.values() if n.op == "MatMul" and n.device.endswith("CPU:1")]
    assert copies and not any(n.op == "MatMul" and n.device.endswith("CPU:1")
                              for n in placed.values())
    assert any(n.op.startswith("EplAllReduce") for n in cloned.values())
    assert not any(n.op.startswith("EplAllReduce") for n in placed.values())
    assert set(PASSES.seconds) >= {"clone_replicas", "merge_outputs"}
