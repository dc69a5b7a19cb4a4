"""A weight a step reads from memory (epl/auto/cold_reads.py): the planner times kernels
in chains, weights hot, while a step whose variables outgrow the last-level cache reads
each weight cold once (stop 59, AMD EPYC with 32 MiB of L3: the MLP's fused layer took
0.42 ms hot, 0.68 cold, 0.60-0.68 in its step; the rule adds 1.7 ms to its one-device
step of 15.5)."""
import numpy as np
import pytest
import tensorflow as tf

from epl.auto import cold_reads, local_step

v1 = tf.compat.v1


def test_each_weight_is_charged_to_the_first_kernel_that_reads_it():
    with tf.Graph().as_default() as graph:
        w = v1.get_variable("w", [16, 8], use_resource=False)
        b = v1.get_variable("b", [8], use_resource=False)
        x = tf.ones([4, 16])
        first = tf.matmul(x, w)                      # reads w through w/read
        again = tf.matmul(2.0 * x, w)                # w again: in the cache
        out = tf.nn.bias_add(first + again, b)
    ops = graph.get_operations()
    reads = dict(zip([op.name for op in ops], cold_reads.first_reads(ops)))
    assert reads[first.op.name] == 16 * 8 * 4
    assert reads[again.op.name] == 0
    assert reads[out.op.name] == 8 * 4
    assert reads["w/read"] == 0                      # a view of the variable, no kernel
    assert sum(reads.values()) == (16 * 8 + 8) * 4
    assert cold_reads.state_bytes(ops) == (16 * 8 + 8) * 4


def test_the_cold_rate_applies_only_where_the_variables_outgrow_the_cache():
    timing = {"alone": 2e-11, "cache": 32 << 20}
    assert cold_reads.per_byte(timing, 60 << 20) == 2e-11
    assert cold_reads.per_byte(timing, 16 << 20) == 0.0
    assert cold_reads.per_byte(None, 60 << 20) == 0.0
    assert cold_reads.per_byte({"alone": 2e-11, "cache": None}, 60 << 20) == 0.0


def _two_kernels(**flow):
    """A flow of two 1 ms kernels in a chain with ``flow``'s reads, their timings, costs
    with a cold rate of 1e-10 s a byte and a 32 MiB cache, and 4 MiB's cold seconds."""
    return (dict(dict(sigs=["k", "k"], flops=[0.0, 0.0], deps=[[], [0]], inputs=[],
                      hops=[0, 0], updates=[]), **flow),
            {"k": {"alone": 1e-3, "shared": 1e-3}},
            dict(op=0.0, handoff=0.0, hop=0.0, cold={"alone": 1e-10, "cache": 32 << 20}),
            (4 << 20) * 1e-10)


def test_the_replay_adds_the_first_reads_once_per_process():
    """A chain of two kernels, 1 ms each; the first reads 4 MiB of weights cold at
    1e-10 s a byte (0.42 ms): one replica pays it; two replicas in one process share
    the variables, so each pays half; two processes each pay it whole."""
    flow, timings, costs, cold_s = _two_kernels(reads=[4 << 20, 0], state=64 << 20)
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 1) == pytest.approx(
        2e-3 + cold_s)
    assert local_step.replay(dict(flow, state=16 << 20), timings, costs, 0.0, 2, 1e9,
                             1) == pytest.approx(2e-3)
    hot = dict(costs, cold=None)
    one = local_step.replay(flow, timings, hot, 0.0, 2, 1e9, 2)
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 2) == pytest.approx(
        one + cold_s / 2, rel=1e-6)
    both = local_step.replay(flow, timings, hot, 0.0, 2, 1e9, 2, 2)
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 2, 2) == pytest.approx(
        both + cold_s, rel=1e-6)


def test_an_activation_read_after_the_cache_has_been_filled_since_is_cold():
    """``saved`` (4 KiB) is written, then 16 KiB of other outputs (a constant and its
    sum), then read twice: with a 6 KiB cache its first reader fetches it cold and the
    second finds it in the cache; with a 64 KiB cache neither does; a variable's value
    is never an activation."""
    with tf.Graph().as_default() as graph:
        w = v1.get_variable("w", [32, 32], use_resource=False)
        saved = tf.ones([32, 32]) * 2.0                       # 4 KiB
        other = tf.ones([64, 32]) + 1.0                       # 8 KiB written since
        late = tf.matmul(saved, w, name="late")               # its first reader: cold
        later = tf.add(saved, 1.0, name="later")              # right after: hot
        tf.add_n([late, later, tf.reduce_sum(other) * tf.ones([32, 32])])
    ops = graph.get_operations()
    names = [op.name for op in ops]
    assert names.index(other.op.name) < names.index("late") < names.index("later")
    cold = dict(zip(names, cold_reads.cold_activations(ops, 6 << 10, 32)))
    assert cold["late"] == 32 * 32 * 4
    assert cold["later"] == 0
    assert sum(cold_reads.cold_activations(ops, 64 << 10, 32)) == 0
    assert sum(cold_reads.cold_activations(ops, None, 32)) == 0


def test_the_replay_adds_each_replicas_cold_activations():
    """Two kernels of 1 ms; the second reads 4 MiB of activations cold at 1e-10 s a
    byte: one replica pays it, and each of two replicas pays its own (they share no
    activations), whether or not the variables outgrow the cache."""
    flow, timings, costs, cold_s = _two_kernels(reads=[0, 0], state=16 << 20,
                                                cold=[0, 4 << 20])
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 1) == pytest.approx(
        2e-3 + cold_s)
    hot = dict(costs, cold=None)
    assert local_step.replay(flow, timings, hot, 0.0, 2, 1e9, 1) == pytest.approx(2e-3)
    one = local_step.replay(flow, timings, hot, 0.0, 2, 1e9, 2)
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 2) == pytest.approx(
        one + cold_s, rel=1e-6)


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, level, size in ((0, 1, "48K"), (2, 2, "1024K"), (3, 3, "32768K")):
        d = tmp_path / ("index%d" % index)
        d.mkdir()
        (d / "level").write_text("%d\n" % level)
        (d / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")            # (not a cache: skipped)
    assert cold_reads.cache_bytes(str(tmp_path)) == 32 << 20
    assert cold_reads.cache_bytes(str(tmp_path / "missing")) is None


@pytest.mark.alone      # it times this machine (conftest.py)
def test_the_probe_measures_a_cold_read_rate():
    if cold_reads.cache_bytes() is None:
        pytest.skip("this machine shows no cache sizes (/sys/devices/system/cpu)")
    got = cold_reads.measure(budget=0.2)
    assert got["cache"] == cold_reads.cache_bytes()
    # at least 1 GB/s a byte read from memory (not a stall); it may read 0: TF 2.x's
    # oneDNN products hide most of it (AMD EPYC, 32 MiB: 67-86 GB/s, once 0; TF 1.15's
    # Eigen 15-18 GB/s), and a cache over the probe's 1 GiB of weights keeps them warm
    assert 0.0 <= got["alone"] <= 1e-9, got
    assert got["shared"] == got["alone"] and np.isfinite(got["shared"])
