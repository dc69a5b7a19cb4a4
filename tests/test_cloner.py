"""CopyPlan: a node described once, copied per clone by filling holes, imported at once.

The copies must be exactly the NodeDefs a clone would get one by one: names under the
clone's prefix, inputs inside the copy or mapped to existing tensors, per-clone devices
and attributes -- including when a length byte of the serialized protobuf is ``%``
(0x25), which the ``bytes %`` pattern must not read as a format directive.
"""
import struct

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from epl.rewrite import cloner
from epl.rewrite.cloner import PREFIX, CopyPlan, Hole
from epl.tf_adapter import deferred


@pytest.fixture(autouse=True)
def _lazy_wrappers():
    # Looking up an imported copy by name needs the adapter's lazy-wrapper hooks, and
    # nothing else of EPL (no epl.init, no cluster).
    deferred.install_hooks()


ONE = struct.unpack("<f", b"%%%?")[0]     # a constant whose bytes are '%'s


def _plan_and_graph(name):
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.arange(3, dtype=np.float32), name="x")
        y = tf.identity(x * 2.0, name="scaled")
        tmpl = tf.Graph()
        with tmpl.as_default():
            a = tf.placeholder(tf.float32, [3], name="a")
            b = tf.add(a, ONE, name=name)
            c = tf.multiply(b, b, name="sq")
    plan = CopyPlan()
    seed = Hole("seed")
    ops = {op.name: op for op in tmpl.get_operations()}
    # "a" is not copied: the copies read an existing tensor through a key.
    add_y = ops[name].inputs[1].op.name
    plan.node(add_y, cloner.template(ops[add_y])[0], [], [], (Hole("d"),))
    plan.node(name, cloner.template(ops[name])[0], [(PREFIX, "KEY_a"), (PREFIX, add_y)], [],
              (Hole("d"),))
    plan.node("sq", cloner.template(ops["sq"])[0], [(PREFIX, name), (PREFIX, name)],
              [(PREFIX, add_y)], (Hole("d"),), [seed])
    return g, plan, x, y, seed, (b, c)


def test_copies_imported_once_with_filled_holes():
    # A name of 34 bytes + prefix "C1/" is a field of 37 bytes: its length byte is '%'.
    name = "n" * 34
    g, plan, x, y, seed, _ = _plan_and_graph(name)
    entry = cloner.attr_entry("_epl_test", tf.AttrValue(i=7))
    for c, src in ((1, x), (2, y)):
        plan.copy({PREFIX: "C%d/" % c, Hole("d"): "/device:CPU:0", seed: entry},
                  {"C%d/KEY_a" % c: src})
    names, = cloner.import_copies(g, [plan])
    assert names == plan.names
    with g.as_default():
        assert g.get_operation_by_name("C2/sq").get_attr("_epl_test") == 7
        assert [i.name for i in g.get_operation_by_name("C1/sq").control_inputs] == [
            "C1/" + plan.nodes[0][0]]
        with tf.Session() as sess:
            one, two = sess.run(["C1/sq:0", "C2/sq:0"])
    np.testing.assert_allclose(one, (np.arange(3) + ONE) ** 2, rtol=1e-6)
    np.testing.assert_allclose(two, (np.arange(3) * 2.0 + ONE) ** 2, rtol=1e-6)


def test_copy_named_like_an_existing_op_gets_a_suffix():
    g, plan, x, _, seed, _ = _plan_and_graph("b")
    with g.as_default():
        tf.constant(0.0, name="C1/sq")     # taken before the import
    plan.copy({PREFIX: "C1/", Hole("d"): "", seed: cloner.attr_entry(
        "_epl_test", tf.AttrValue(i=1))}, {"C1/KEY_a": x})
    names, = cloner.import_copies(g, [plan])
    assert names[-1] != "C1/sq" and names[-1].startswith("C1/sq")
    with g.as_default(), tf.Session() as sess:
        np.testing.assert_allclose(sess.run(names[-1] + ":0"), (np.arange(3) + ONE) ** 2,
                                   rtol=1e-6)
