"""The executor's costs ``local_step.timed`` hands the replay (epl/auto/local_step.py).

The hand-off: what a one-thread kernel's lone run costs beyond its chain, which every
kernel's wake-up is measured net of.  Stop 61 (AMD EPYC): one 16 x 16 product's probe
(``HANDOFF``) read 0-20 us from model to model in one run (19.6 us for the mini-BERT in
both rounds, whose rows then read 15-25 % fast), while the median over each model's
one-thread kernels read 5.4-6.7 us for every model.
"""
import json

from epl.auto import local_step, product_timing


def _kernel(i, alone, first):
    return json.dumps(["kernel", "K%d" % i, "", []]), {
        "alone": alone, "shared": alone, "first": first, "first_shared": first}


def test_the_hand_off_is_the_median_over_the_one_thread_kernels():
    timings = dict(_kernel(i, 0.5e-6, 0.5e-6 + d)
                   for i, d in enumerate((5e-6, 6e-6, 7e-6, 6.5e-6, 5.5e-6, 40e-6)))
    wide = dict([_kernel(99, 80e-6, 300e-6)])            # many threads: not counted
    probe = {product_timing.HANDOFF: {"alone": 0.7e-6, "first": 20.3e-6}}
    update = {json.dumps(["update", "ApplyAdam", "x"]): {"alone": 0.2e-6, "first": 90e-6}}
    got = local_step.handoff_seconds(dict(timings, **dict(wide, **dict(probe, **update))))
    assert abs(got - 6.5e-6) < 1e-12


def test_too_few_one_thread_kernels_fall_back_to_the_probe():
    timings = dict(_kernel(i, 0.5e-6, 6e-6) for i in range(local_step.ONE_THREAD_LEAST - 1))
    timings[product_timing.HANDOFF] = {"alone": 1.5e-6, "first": 31.5e-6}
    assert abs(local_step.handoff_seconds(timings) - 30e-6) < 1e-12
    assert local_step.handoff_seconds({}) == 0.0


def _sums_graph():
    """Two micro-batches' gradients summed by EPL's collective on device 0 (one op per
    rank), and two replicas' gradients summed across devices 0 and 1."""
    import numpy as np
    import tensorflow as tf
    from epl import ir
    from epl.communicators import native_ops
    from epl.tf_adapter import graph as tfg
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 256])
        w = tf.constant(np.ones((256, 256), np.float32))
        grads = [v1.matmul(x, w), v1.matmul(v1.matmul(x, w), w)]
        local = [native_ops.all_reduce_n([g], "micro", r, 2, transport="inprocess")[0]
                 for r, g in enumerate(grads)]
        across = [native_ops.all_reduce_n([g], "replicas", r, 2, transport="inprocess")[0]
                  for r, g in enumerate(grads)]
        done = tf.group(*(local + across))
    ops = sorted(ir.upstream([done]), key=tfg.op_id)
    devices = dict((op.name, "/device:CPU:0") for op in ops)
    devices[across[1].op.name] = "/device:CPU:1"
    return ops, devices, local, across


def test_a_micro_batch_sum_is_priced_on_its_last_rank_by_its_bytes():
    """EPL sums a pipeline's micro-batch gradients with its own collective, one op per
    micro-batch, the last to arrive adding them all (csrc/collectives.cc): the replay
    priced it as an op without a kernel (stop 62: 8 ranks of 4 MiB took 1.0 ms; the
    MLP's pipelines read 11-19 % fast).  Ranks on different devices are data
    parallelism's all-reduce, priced by the cluster's links, not here."""
    from epl.auto import step_graph
    ops, devices, local, across = _sums_graph()
    flow = step_graph.dataflow(ops, 64, devices)
    one = 64 * 256 * 4
    last = ops.index(local[1].op)
    assert flow["sums"] == [(last, 3 * one)]       # two ranks' inputs read, one written
    jobs_at = dict(flow["sums"])
    assert ops.index(across[1].op) not in jobs_at
    timings = {}
    costs = dict(op=1e-7, handoff=0.0, hop=0.0, cold=None, mix=0.0)
    plain = local_step.replay(flow, timings, costs, 0.0, 2, 1e12, 1)
    priced = local_step.replay(flow, timings, costs, 0.0, 2, 1e12, 1, bandwidth=1e9)
    # (nothing else costs more than op overhead: the sum's bytes at 1 GB/s over 2 cores)
    assert abs((priced - plain) - 3 * one / 1e9) < 3 * one / 1e9 * 0.05 + 1e-6
