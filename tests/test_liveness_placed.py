"""The planner's memory for a pipeline's step on ``Cluster.local``: the step EPL's
rewrite builds, walked device by device (``liveness.device_peaks``), against
hand-counted steps and against TensorFlow's traced allocations of the same step run
(issue 36: the stages' sums under-predicted a ResNet's 2-stage 1F1B pipeline by 10.9 %)."""
import numpy as np
import pytest
import tensorflow as tf

from epl import ir
from epl.auto import graph_profile, liveness, local_step, search
from epl.auto.layout import Layout
from epl.communicators import native_ops
from epl.tf_adapter import graph as tfg
from epl.tf_adapter import version

v1 = tf.compat.v1
ROWS, WIDTH = 64, 256
ONE = ROWS * WIDTH * 4          # bytes of one [ROWS, WIDTH] float32 tensor (64 KiB)


def _w():
    return tf.constant(np.ones((WIDTH, WIDTH), np.float32))     # a Const: no step bytes


def _ops(*outs):
    return sorted(ir.upstream([o.op if hasattr(o, "op") else o for o in outs]),
                  key=tfg.op_id)


def test_an_in_place_result_nobody_reads_is_freed():
    """``relu(a)`` writes into ``a``'s buffer and nobody reads it: the buffer goes at
    once (it stayed alive for the rest of the step before: a pipeline stage's last
    activation, read only on the next stage, piled up per micro-batch)."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH])
        a = v1.matmul(x, _w())
        r = tf.nn.relu(a)                       # in place, read by nobody
        b = v1.matmul(x, _w())
        c = v1.matmul(b, _w())
        done = tf.group(r.op, tf.reduce_sum(c).op)
        assert liveness.peak_bytes(_ops(done), ROWS) == 2 * ONE     # a + b, then b + c


def test_the_ranks_of_a_collective_wait_for_each_other():
    """Two micro-batches' gradients summed by EPL's collective (one op per rank): the
    first waits, its input held, until the second is made (the walk ran it at once)."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH])
        g0 = v1.matmul(x, _w())
        h = v1.matmul(v1.matmul(x, _w()), _w())
        g1 = v1.matmul(h, _w())
        sums = [native_ops.all_reduce_n([g], "grads", rank, 2, transport="inprocess")[0]
                for rank, g in enumerate([g0, g1])]
        ops = _ops(tf.group(*sums))
        order = liveness.dataflow_order(ops)
        ranks = [order.index(s.op) for s in sums]
        assert ranks[1] == ranks[0] + 1 and ranks[0] > order.index(g1.op)
        # g0 and the first product's output, then g0, h and g1 alive; the sums'
        # output is the collective's buffer kept across steps (not the step's)
        assert liveness.peak_bytes(ops, ROWS) == 3 * ONE


def test_a_tensor_read_on_another_device_counts_where_it_was_made():
    """The virtual CPU devices share the host's memory: a stage's output read by the
    next stage is not copied; it counts on its maker until its last reader there."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH])
        a = v1.matmul(x, _w())                  # device 0
        r = tf.nn.relu(a)                       # device 1, in place: still device 0's
        c = v1.matmul(r, _w())                  # device 1
        d = v1.matmul(c, _w())                  # device 1
        total = tf.reduce_sum(d)                # device 1
        ops = _ops(total)
        on = dict((op, "d1" if op in (r.op, c.op, d.op, total.op) else "d0") for op in ops)
        got = liveness.device_peaks(ops, ROWS, on.get)
        assert got["d0"] == ONE                 # a (r in place) until c has read it
        assert got["d1"] == 2 * ONE             # c + d (a received copy: 3 x ONE)


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(4 * ROWS, WIDTH).astype(np.float32)
    y = rng.randint(0, 16, 4 * ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ROWS,
                                                                    drop_remainder=True)


def _mlp(features):
    x, y = features
    for i in range(4):
        x = v1.layers.dense(x, WIDTH, activation=tf.nn.relu, name="layer_%d" % i)
    return v1.losses.sparse_softmax_cross_entropy(
        labels=y, logits=v1.layers.dense(x, 16, name="logits"))


def _convnet(features):
    x, y = features
    x = tf.reshape(x, [-1, 16, 16, 1])
    for i in range(3):
        x = v1.layers.conv2d(x, 16, 3, padding="same", activation=tf.nn.relu,
                             name="layer_%d" % i)
    return v1.losses.sparse_softmax_cross_entropy(
        labels=y, logits=v1.layers.dense(tf.reshape(x, [-1, 16 * 16 * 16]), 16,
                                         name="logits"))


def _adam():
    return v1.train.AdamOptimizer(1e-3)


@pytest.mark.parametrize("model_fn", [_mlp, _convnet])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipelines_memory_is_its_built_step_walked(model_fn, schedule):
    """2 stages x 4 micro-batches run by EPL (the fullest device's traced peak and its
    variables, as ``plan_accuracy`` measures) against ``predict``'s figure from the
    built step, never run: within 10 % (the ResNet, MLP, GPT, wide head and mini-BERT
    of benchmarks/plan_accuracy.py: -6 % to +12 %)."""
    fns = (model_fn, _data, _adam)
    lay = Layout(p=2, num_micro_batch=4, schedule=schedule)
    strategy = ["pipeline", {"num_stages": 2, "num_micro_batch": 4, "schedule": schedule}]
    status, got = search.measure(fns, [strategy], 2, steps=1, timeout=300)
    assert status == "ok", got
    prof = graph_profile.profile(*fns)
    placed = local_step.placed_memory(prof.built_dataflow(lay.to_config(2)))
    assert len(placed) == 2
    # (oneDNN's kernels, TF 2.x on AVX-512 CPUs, leave a peak of a few 1 MiB tensors,
    # which the executor's order of sibling kernels moves by one: traced 4.1-4.8 MiB for
    # the same conv net step; TensorFlow's own kernels' scratch dominates and holds)
    tolerance = 0.20 if version.onednn_enabled() else 0.10
    assert max(placed) == pytest.approx(got["peak_bytes"], rel=tolerance), (placed, got)



def _gpt():
    from epl.auto.gpt import GPT
    return GPT(2, 128, 4, seq=128, vocab=500, batch=8)


def _gpt_data():
    return _gpt().dataset_fn()


def _gpt_model(features):
    return _gpt().model_fn(features)


FEATURES = {"gc": (["gradient_checkpoint", "auto"], dict(recompute=True)),
            "amp": (["amp", {"dtype": "bfloat16"}], dict(dtype="bf16"))}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_gc_and_amp_memory_is_their_built_step_walked(feature, tmp_path, monkeypatch):
    """A small GPT on DP 2 with gradient checkpointing or AMP, run by EPL (the fullest
    device, as ``plan_accuracy`` measures) against ``price`` on ``Cluster.local``:
    within 3 % (stop 62: 0.01 % and 0.01 % on TF 1.15).  The closed form (the
    activations summed, times GC's kept share; AMP's 16-bit weight copies added) read
    it 11 % and 7 % over, benchmarks/plan_accuracy.py's conv net 18 % (GC) and 13 %
    (AMP) under on TF 2.x."""
    from epl.auto import Cluster
    from epl.auto import local
    from epl.auto.predictor import price
    from tests import auto_models
    auto_models.install_calibration(dict(
        version=local.CACHE_VERSION, cores=2, matmul_flops=8e10, matmul_flops_fp16=8e7,
        matmul_flops_bf16=4e10, memory_bandwidth=1e10, op_overhead_s=1e-6,
        run_overhead_s=2e-4, allreduce_bandwidth=2e9, allreduce_latency_s=1e-4),
        tmp_path, monkeypatch)
    entry, keys = FEATURES[feature]
    fns = (_gpt_model, _gpt_data, _adam)
    status, got = search.measure(fns, ["data_parallel", entry], 2, steps=1, timeout=300)
    assert status == "ok", got
    predicted = price(graph_profile.profile(*fns), Layout(d=2, **keys), Cluster.local(2))
    tolerance = 0.10 if version.onednn_enabled() else 0.03
    assert predicted.memory_bytes[0] == pytest.approx(got["peak_bytes"], rel=tolerance), \
        (predicted.memory_bytes, got, predicted.breakdown["stages"][0])


def test_gc_memory_falls_back_to_the_closed_form_where_the_model_cannot_be_built(
        tmp_path, monkeypatch, caplog):
    """EPL's built step comes from another process, which must import the model's
    functions: where that fails (a lambda, a notebook), the layout is priced by the
    closed form, with a warning that says so, not refused."""
    from epl.auto import Cluster
    from epl.auto import local
    from epl.auto.predictor import price
    from tests import auto_models
    auto_models.install_calibration(dict(
        version=local.CACHE_VERSION, cores=2, matmul_flops=8e10, matmul_flops_fp16=8e7,
        matmul_flops_bf16=4e10, memory_bandwidth=1e10, op_overhead_s=1e-6,
        run_overhead_s=2e-4, allreduce_bandwidth=2e9, allreduce_latency_s=1e-4),
        tmp_path, monkeypatch)
    prof = graph_profile.profile(_mlp, _data, _adam)

    def unbuildable(config):
        raise RuntimeError("epl.auto: building the model with %r failed: PicklingError"
                           % (config,))
    prof.built_dataflow = unbuildable
    with caplog.at_level("WARNING", logger="epl"):
        got = price(prof, Layout(d=2, recompute=True), Cluster.local(2))
    assert got.memory_bytes[0] > 0
    assert "walked_feature_bytes" not in got.breakdown["stages"][0]
    assert any("closed form" in r.getMessage() for r in caplog.records)
