"""The planner's timed step is the step the session runs (epl/auto/step_graph.py).

A session places every op before Grappler optimizes its graph, and Grappler's remapper
fuses a product with its bias and activation (``_FusedMatMul``) only on a CPU; the
planner's copy of the graph had no devices, so it timed the bare product, the bias and
the ReLU where the session ran one fused kernel (stop 59: the MLP's 5 layers, the
mini-BERT's 14, whose executor-bound step counted 28 ops the session never ran).  The oracle is
a traced step: each kernel the session ran is, by name, the kernel the planner times
(TF 2.x's oneDNN runs its own kernels of the same ops: ``_MklNativeFusedMatMul``)."""
import re

import numpy as np
import tensorflow.compat.v1 as tf

from epl.auto import graph_profile, step_graph
from epl.tf_adapter import grappler

ROWS = 32


def _dataset():
    rng = np.random.RandomState(0)
    x = rng.randn(4 * ROWS, 48).astype(np.float32)
    y = rng.randint(0, 8, 4 * ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ROWS, drop_remainder=True)


def _dense(h, units, name, relu=True):
    w = tf.get_variable(name + "/kernel", [h.shape[-1], units])
    b = tf.get_variable(name + "/bias", [units], initializer=tf.zeros_initializer())
    out = tf.nn.bias_add(tf.matmul(h, w), b)
    return tf.nn.relu(out, name=name + "/Relu") if relu else out


def _model(features):
    x, y = features
    h = _dense(_dense(x, 64, "layer_0"), 64, "layer_1")
    logits = _dense(h, 8, "logits", relu=False)
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def _adam():
    return tf.train.AdamOptimizer(0.01)


def _kernel(op_type):
    """An op type without TF 2.x's oneDNN prefix (``_MklNativeFusedMatMul`` and
    ``_MklFusedMatMul`` run ``_FusedMatMul``; ``_MklMatMul`` runs ``MatMul``)."""
    return re.sub(r"^_Mkl(Native)?(?=[A-Z])", "", op_type).lstrip("_")


def _traced_types(graph, train_op):
    """{node name: op type} of the kernels a traced session step ran."""
    with tf.Session(graph=graph) as sess:
        sess.run(tf.global_variables_initializer())
        meta = tf.RunMetadata()
        sess.run(train_op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=meta)
    out = {}
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            # "name = Type(inputs)", after "[cpu 2.5MB 2.5MB] " where it allocated
            m = re.match(r"(?:\[[^\]]*\]\s*)?([^ ]+) = ([A-Za-z0-9_]+)\(", node.timeline_label)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def test_the_planners_step_holds_the_kernels_the_session_runs():
    graph = tf.Graph()
    with graph.as_default():
        features = tf.data.make_one_shot_iterator(_dataset()).get_next()
        train_op = _adam().minimize(_model(features))
    planned = dict((op.name, op.type)
                   for op in step_graph.optimized_step(graph, train_op, grappler.ON_CPU)())
    bare = set(op.type for op in step_graph.optimized_step(graph, train_op)())
    traced = _traced_types(graph, train_op)
    assert traced.get("layer_0/Relu", "").endswith("FusedMatMul"), traced
    assert planned.get("layer_0/Relu") == "_FusedMatMul", planned.get("layer_0/Relu")
    assert "_FusedMatMul" not in bare       # the graph the memory model reads: as built
    both = [n for n in traced if n in planned]
    assert len(both) >= 10, (sorted(traced), sorted(planned))
    differ = [(n, planned[n], traced[n]) for n in both
              if _kernel(planned[n]) != _kernel(traced[n])]
    assert not differ, differ


def test_the_profiles_dataflow_times_the_fused_kernel():
    prof = graph_profile.profile(_model, _dataset, _adam)
    kinds = [s for s in prof.dataflow()["sigs"] if s and s.startswith('["kernel"')]
    assert sum('"_FusedMatMul"' in s for s in kinds) == 3, kinds   # the logits' too
    assert not any('"Relu"' in s or '"BiasAdd"' in s for s in kinds), kinds


def test_a_kernel_reading_a_variable_in_place_is_timed():
    """Grappler moves AMP's casts next to the weights (``ReorderCastLikeAndValue
    Preserving``), where they read the variable's ref in place: a kernel all the same
    (the AMP MLP's step ran 33 casts; the planner timed 24 of them)."""
    import json
    from epl.auto import product_timing
    with tf.Graph().as_default():
        w = tf.Variable(np.ones([8, 4], np.float32), use_resource=False)
        cast = tf.cast(w._ref(), tf.bfloat16)          # pylint: disable=protected-access
        assert cast.op.inputs[0].dtype._is_ref_dtype    # pylint: disable=protected-access
        sig = product_timing.kernel_signature(cast.op, ROWS)
    assert sig is not None and json.loads(sig)[3] == [["float32", [8, 4], None]]
    with tf.Graph().as_default():
        op = product_timing._build_kernel(sig, np.random.RandomState(0), "/device:CPU:0")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert sess.run(op.outputs[0]).shape == (8, 4)


def test_the_amp_steps_kernels_are_the_planners_and_every_cast_is_timed():
    """The same oracle on the step EPL builds under AMP (bfloat16 products between
    casts, some of them moved next to the weights by Grappler): each kernel the traced
    session ran is the planner's by name, and every cast has a timing signature."""
    import epl
    from epl import rewrite
    from epl.auto import product_timing
    from tests import models
    models.reset()
    epl.init(epl.Config({"amp.level": "O1", "amp.dtype": "bfloat16"}))
    epl.set_default_strategy(epl.replicate(1))
    features = tf.data.make_one_shot_iterator(_dataset()).get_next()
    train_op = _adam().minimize(_model(features),
                                global_step=tf.train.get_or_create_global_step())
    graph = tf.get_default_graph()
    rewrite.rewrite_if_needed(graph)
    ops = step_graph.optimized_step(graph, train_op, grappler.ON_CPU)()
    planned = dict((op.name, op.type) for op in ops)
    traced = _traced_types(graph, train_op)
    both = [n for n in traced if n in planned]
    assert sum(planned[n] == "Cast" for n in both) >= 6, sorted(traced.items())
    differ = [(n, planned[n], traced[n]) for n in both
              if _kernel(planned[n]) != _kernel(traced[n])]
    assert not differ, differ
    untimed = [op.name for op in ops if op.type == "Cast" and op.outputs[0].dtype.is_floating
               and product_timing.kernel_signature(op, ROWS) is None]
    assert not untimed, untimed
