"""The rewrite's pass driver (epl/rewrite/pipeline.py): contracts checked when the
pipeline is built, every pass timed, the graph dumped after each pass on request, and
the default pipeline's passes doing what their contracts say on a small DP program."""
import os

import pytest
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import graph_pb2
from google.protobuf import text_format

import epl
from epl import ir
from epl.core.process_state import Env
from epl.rewrite import PASSES, prepare_state
from epl.rewrite.pipeline import Pass, PassContext, PassOrderError, PassPipeline
from epl.rewrite.state import CLONE_MAPS, CloneMaps, UndeclaredProduct
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
    assert rebuilt.names()[:5] == ["place_originals", "place_original_bodies", "reinstall",
                                   "shard_inputs", "clone_replicas"]
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


# ------------------------------------------------------------------ products and the plan

def _dp_rewrite():
    """The ``Rewrite`` of a small DP x2 program before any pass ran."""
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    w = tf.get_variable("w", [3, 1])
    loss = tf.reduce_mean(tf.matmul(x, w, name="pred"))
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    env = Env.get()
    return prepare_state(ir.Graph.get(), env.config, env.cluster), x


def test_a_pass_reaches_only_the_products_its_contract_names():
    rewrite, x = _dp_rewrite()
    seen = {}

    def make(c):
        seen["maps"] = c.make(CLONE_MAPS, lambda: CloneMaps(c.state.graph, 2), kept=True)
        seen["tmp"] = c.make("tmp", dict)

    def reader(c):
        seen["tensor"] = c.state.tensor(1, x)       # declared: the clone maps' look-up
        assert c.product("tmp") is seen["tmp"] and c.product(CLONE_MAPS) is seen["maps"]

    ok = PassPipeline([Pass("make", make, provides={CLONE_MAPS, "tmp"}),
                       Pass("read", reader, requires={CLONE_MAPS, "tmp"})])
    ok.run(PassContext(rewrite, rewrite.selection, -1, True), dump_dir="")
    assert seen["tensor"] is x
    # Kept products live with the graph's Rewrite; the others end with the run.
    assert rewrite.products == {CLONE_MAPS: seen["maps"]}

    def undeclared_maps(c):
        c.state.tensor(1, x)

    def undeclared_product(c):
        c.product("tmp")

    def undeclared_write(c):
        c.state.substitute(x, [x, x], lambda op: True)   # reads the maps, may not extend

    for bad, message in ((undeclared_maps, "'sneak' reads the clone maps"),
                         (undeclared_product, "'sneak' uses the product 'tmp'"),
                         (undeclared_write, "'sneak' changes the clone maps")):
        pipe = PassPipeline([Pass("make", make, provides={CLONE_MAPS, "tmp"}),
                             Pass("sneak", bad,
                                  requires={CLONE_MAPS} if bad is undeclared_write else ())])
        with pytest.raises(UndeclaredProduct, match=message):
            pipe.run(PassContext(rewrite, rewrite.selection, -1, True), dump_dir="")


def test_a_product_is_read_only_after_the_pass_that_makes_it():
    with pytest.raises(PassOrderError, match="'clone' requires \\['templates'\\]"):
        PassPipeline([Pass("clone", _noop, requires={"templates"}),
                      Pass("place", _noop, provides={"templates"})])
    with pytest.raises(PassOrderError, match="'shard' requires \\['clone_maps'\\]"):
        PassPipeline([Pass("shard", _noop, extends={CLONE_MAPS})])


def test_the_plan_is_fixed_and_every_default_pass_declares_what_it_reads():
    rewrite, _ = _dp_rewrite()
    with pytest.raises(AttributeError, match="fixed before the passes run"):
        rewrite.plan.layout = None
    with pytest.raises(AttributeError, match="fixed before the passes run"):
        rewrite.selection = None
    PASSES.run(PassContext(rewrite, rewrite.selection, -1, True), dump_dir="")
    # (each pass reached only its declared products: an undeclared read raises)
    assert set(rewrite.products) == {CLONE_MAPS, "sharded_inputs", "copied_contexts",
                                     "schedule", "merged"}
    assert "templates" not in rewrite.products     # (this run's: dropped)
    assert rewrite.op(1, ir.Graph.get().taskgraphs[0].ops[-1]) is not None
    contracts = {p.name: p for p in PASSES.passes}
    assert CLONE_MAPS in contracts["reinstall"].provides
    assert CLONE_MAPS in contracts["clone_replicas"].extends
    assert "templates" in contracts["place_originals"].provides
    assert "templates" in contracts["clone_replicas"].requires
