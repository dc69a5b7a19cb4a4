"""The planner's liveness walk (``epl.auto.liveness``) against hand-counted steps and
against the peak TensorFlow's allocator records for a traced step (issue 36: summing
all activations and gradients over-predicted the corpus GPT by 15 %)."""
import numpy as np
import pytest
import tensorflow as tf

from epl import ir
from epl.auto import graph_profile, liveness
from epl.auto.gpt import GPT
from epl.ir.memory_trace import peak_bytes as traced_peak, traced_run
from epl.tf_adapter import graph as tfg

v1 = tf.compat.v1
ROWS, WIDTH = 64, 256
ONE = ROWS * WIDTH * 4          # bytes of one [ROWS, WIDTH] float32 tensor


def _w():
    return tf.constant(np.ones((WIDTH, WIDTH), np.float32))     # a Const: no step bytes


def _walk(build, updates_last=False):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH])
        out = build(x)
        return liveness.peak_bytes(sorted(ir.upstream([out.op]), key=tfg.op_id), ROWS,
                                   updates_last)


def test_element_wise_chains_write_in_place_and_views_cost_nothing():
    def chain(x):
        y = v1.matmul(x, _w())        # one buffer
        y = tf.nn.relu(y)                                # its last reader: in place
        y = tf.reshape(y, [-1, WIDTH // 2, 2])           # a view
        y = y * 2.0 + 1.0                                # in place, twice
        return tf.reduce_sum(y)
    assert _walk(chain) == ONE + 4          # (+ the scalar sum)


def test_a_tensor_read_twice_is_not_overwritten():
    def fork(x):
        y = v1.matmul(x, _w())
        a = tf.nn.relu(y)                 # y is still read below: a new buffer
        b = tf.nn.sigmoid(y)              # y's last reader: in place
        return tf.reduce_sum(a + b)       # a + b into a's buffer
    assert _walk(fork) == 2 * ONE


def test_a_tensor_is_freed_after_its_last_reader():
    def sequence(x):
        ys = [v1.matmul(x, _w())]
        for _ in range(4):                 # each product reads the one before
            ys.append(v1.matmul(ys[-1], _w()))
        return tf.reduce_sum(ys[-1])
    assert _walk(sequence) == 2 * ONE      # never more than two alive


def _one_rank_all_reduce_step(reduce_n):
    """a, b = x @ w, x @ w2; ra, rb = EPL's all-reduce of them over one rank; then c =
    ra @ w (after rb) while rb waits: (graph, fetch, feed)."""
    from epl.communicators import native_ops
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH])
        twice = tf.constant(np.full((WIDTH, WIDTH), 2.0, np.float32))
        a, b = v1.matmul(x, _w()), v1.matmul(x, twice)
        if reduce_n:
            ra, rb = native_ops.all_reduce_n([a, b], "liveness/one_n", 0, 1, "sum")
        else:
            ra = native_ops.all_reduce(a, "liveness/one_a", 0, 1, "sum")
            rb = native_ops.all_reduce(b, "liveness/one_b", 0, 1, "sum")
        with tf.control_dependencies([rb]):     # (b before c, whatever the executor picks)
            c = v1.matmul(ra, _w())
        with tf.control_dependencies([c]):
            out = tf.reduce_sum(c) + tf.reduce_sum(rb)
    return graph, out, x


@pytest.mark.parametrize("reduce_n", [True, False])
def test_an_all_reduce_of_one_rank_passes_its_inputs_through(reduce_n):
    """EPL's all-reduce over one rank (a replica alone) outputs its inputs: a and b stay
    alive while c is made (3 buffers), as the traced step holds them; with a copy into
    the group's kept buffer they were freed at the all-reduce (1 buffer)."""
    from epl.communicators import native_library
    if not native_library.available():
        pytest.skip("EPL's C++ op library is not built")
    graph, out, x = _one_rank_all_reduce_step(reduce_n)
    walked = liveness.peak_bytes(sorted(ir.upstream([out.op]), key=tfg.op_id), ROWS)
    assert walked >= 3 * ONE and walked <= 3 * ONE + 64, walked
    with graph.as_default(), v1.Session() as sess:
        feed = {x: np.ones((ROWS, WIDTH), np.float32)}
        sess.run(out, feed)
        _, md = traced_run(sess, out, feed)
    assert abs(traced_peak(md) - walked) <= 0.05 * walked, (traced_peak(md), walked)


def test_the_gpt_step_matches_the_traced_peak():
    """The model the summed estimate missed by 15 %: within 8 % of the traced peak
    (measured 2.5 %), and the summed figure is further off than the walk."""
    gpt = GPT(2, 128, 4, seq=64, vocab=1000, batch=4)
    prof = graph_profile.profile(gpt.model_fn, gpt.dataset_fn, gpt.optimizer_fn)
    walked = prof.step_peak()
    with tf.Graph().as_default():
        measured = traced_peak(_traced_step(gpt))
    summed = sum(r.saved for r in [prof.pre, prof.post] + prof.blocks) * prof.rows \
        + 4 * prof.params()
    assert abs(walked - measured) <= 0.08 * measured, (walked, measured)
    assert abs(walked - measured) < abs(summed - measured), (walked, summed, measured)
    # data parallelism holds every gradient until the all-reduce: never less
    assert prof.step_peak(updates_last=True) >= walked
    assert np.isfinite(walked)


def test_convolution_gradients_scratch_as_traced():
    """A convolution's gradient kernels unfold patches into a scratch buffer the graph
    does not show (measured: up to 23 MiB per kernel on the corpus conv net, the peak
    under-predicted by 35 % without it): ``scratch_bytes`` against the bytes each
    kernel allocated beyond its output in a traced step."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf.constant(rng.rand(16, 16, 16, 32).astype(np.float32))
        y = x
        for i, (k, ch) in enumerate(((3, 32), (1, 64), (3, 128))):   # two kernel paths
            y = tf.nn.relu(v1.layers.conv2d(y, ch, k, padding="same", name="c%d" % i))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(y * y))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            _, md = traced_run(sess, train)
    checked = 0
    for dev in md.step_stats.dev_stats:
        for node in dev.node_stats:
            if ":" in node.node_name or "Backprop" not in node.node_name:
                continue
            op = graph.get_operation_by_name(node.node_name)
            allocated = sum(r.alloc_bytes for m in node.memory
                            for r in m.allocation_records if r.alloc_bytes > 0)
            output = sum(o.tensor_description.allocation_description.requested_bytes
                         for o in node.output)
            assert liveness.scratch_bytes(op) == pytest.approx(allocated - output,
                                                               rel=0.05, abs=64 << 10)
            checked += 1
    assert checked >= 5


def _traced_step(gpt):
    """The run metadata of a traced second training step of ``gpt`` (seed 0), built in
    the default graph."""
    v1.set_random_seed(0)
    features = v1.data.make_one_shot_iterator(gpt.dataset_fn()).get_next()
    train = gpt.optimizer_fn().minimize(gpt.model_fn(features))
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        sess.run(train)
        return traced_run(sess, train)[1]


def test_the_split_gpt_step_walks_as_its_split():
    """The whole GPT's step walked as its ``epl.split(2)`` (``step_peak(t=2)``: its
    sharded tensors, their gradients and the sharded weights' gradients at half their
    bytes; the LM head tied to the embedding whole, as EPL runs it) is within 10 % of
    the fullest device's traced peak of the split model EPL builds on 2 devices
    (measured: 9.40 MB walked, 9.53 traced; in ``plan_accuracy`` the GPT's TP 2 row
    was priced +8 % and the MLP's +17 % by summing the split's activations and
    gradients, as before: +3 % and +11 % after)."""
    import epl
    from epl.communicators import native_library
    from epl.core.process_state import Env
    if not native_library.available():
        pytest.skip("EPL's C++ op library is not built")
    kw = dict(seq=64, vocab=1000, batch=4)
    gpt = GPT(2, 128, 4, **kw)
    prof = graph_profile.profile(gpt.model_fn, gpt.dataset_fn, gpt.optimizer_fn)
    walked = prof.step_peak(updates_last=True, side_by_side=False, t=2)
    # the LM head reads the embedding's shards' concatenation: not sharded
    assert not [n for n in prof.split[0] if n.startswith("gpt/MatMul")], prof.split[0]
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    md = _traced_step(GPT(2, 128, 4, split=2, **kw))
    cluster = Env.get().cluster
    measured = max(traced_peak(md, cluster.local_device(i)) for i in range(2))
    assert abs(walked - measured) <= 0.10 * measured, (walked, measured)
    assert walked < 0.8 * prof.step_peak(updates_last=True), walked


def _square_mlp():
    """512 -> 1024 -> 1024 -> 1024: EPL's split runs layer_0 and layer_2 column-
    parallel (their outputs sharded), layer_1 row-parallel (its output summed)."""
    def dataset_fn():
        x = np.zeros((ROWS, 512), np.float32)
        return v1.data.Dataset.from_tensors(x).repeat()

    def model_fn(x):
        h = x
        for i in range(3):
            h = v1.layers.dense(h, 1024, activation=tf.nn.relu, name="layer_%d" % i)
        return tf.reduce_sum(h)
    return model_fn, dataset_fn, lambda: v1.train.GradientDescentOptimizer(0.1)


def test_a_square_column_parallel_layers_input_gradient_is_whole():
    """The gradient of a column-parallel layer's input is whole under EPL's split (it
    sums it); a square layer's has the shape of its sharded output, and the shape rule
    counted it at half (stop 70).  A row-parallel layer's input gradient and every
    sharded kernel's gradient stay at half."""
    from epl.auto import step_graph
    model_fn, dataset_fn, optimizer_fn = _square_mlp()
    prof = graph_profile.profile(model_fn, dataset_fn, optimizer_fn)
    share = step_graph.split_share(prof.split, 2, ROWS)
    graph = tf.Graph()
    with graph.as_default():        # the same names as the profile's graph
        x = v1.data.make_one_shot_iterator(dataset_fn()).get_next()
        optimizer_fn().minimize(model_fn(x))
        t = graph.get_tensor_by_name
        assert share(t("layer_0/Relu:0")) == 0.5            # column-parallel output
        assert share(t("layer_1/MatMul:0")) == 1.0          # row-parallel: summed
        assert share(t("layer_2/Relu:0")) == 0.5
        grad = "gradients/layer_%d/MatMul_grad/MatMul%s:0"
        assert share(t(grad % (1, ""))) == 0.5     # the row-parallel layer's input
        assert share(t(grad % (2, ""))) == 1.0     # the square column-parallel's input
        for i in range(3):                         # every kernel's gradient
            assert share(t(grad % (i, "_1"))) == 0.5, i
