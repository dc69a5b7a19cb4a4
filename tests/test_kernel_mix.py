"""A cheap kernel in a step costs more than in a chain of its own copies
(epl/auto/kernel_mix.py): the kernels before it differ.  Stop 60, AMD EPYC: the corpus
mini-BERT's 766 cheap kernels took 0.84-0.93 ms one after another in its step's order
against 0.69 ms of chains, and its one-device step, 1290 ops of 1-3 us, was priced 16 %
fast; with each cheap kernel's excess priced, 4 %."""
import json

import numpy as np
import pytest
import tensorflow as tf

from epl.auto import dataflow, kernel_mix, local_step, product_timing, step_graph

v1 = tf.compat.v1

CHEAP, WIDE = 2e-6, 5e-4


def _kernel(name):
    return json.dumps(["kernel", name, "", []])


def _flow(sigs, updates=()):
    n = len(sigs)
    return dict(sigs=sigs, flops=[0.0] * n, deps=[[i - 1] if i else [] for i in range(n)],
                inputs=[], hops=[0] * n, updates=list(updates), reads=[0] * n, state=0)


def test_the_probe_is_the_steps_cheap_kernels_in_its_order():
    """Kernels under INLINE_S alone, in the step's order and repeated as the step
    repeats them; not a wide kernel, a product, an update or an untimed kernel."""
    a, b, wide, untimed, upd = (_kernel(k) for k in ("A", "B", "W", "U", "Apply"))
    product = json.dumps(["MatMul", [[2, 2], [2, 2], [2, 2]], {}])
    timings = {a: {"alone": CHEAP}, b: {"alone": 3e-6}, wide: {"alone": WIDE},
               untimed: None, upd: {"alone": CHEAP}, product: {"alone": CHEAP}}
    flow = _flow([b, None, a, wide, product, untimed, upd, a], updates=[(6, "")])
    assert kernel_mix.sequence(flow, timings) == [b, a, a]
    assert dataflow.INLINE_S > 3e-6


def test_the_excess_is_the_probe_less_the_kernels_mean_chain_time():
    a, b = _kernel("A"), _kernel("B")
    timings = {a: {"alone": 1e-6}, b: {"alone": 3e-6}}
    seq = [a, b, b, b]                              # mean chain time 2.5 us
    assert kernel_mix.excess(seq, timings, {"alone": 3e-6}) == pytest.approx(0.5e-6)
    assert kernel_mix.excess(seq, timings, {"alone": 2e-6}) == 0.0   # never below
    assert kernel_mix.excess(seq, timings, None) == 0.0
    # a probe that ran only the first two kernels (its bytes' bound) is set against them
    assert kernel_mix.excess(seq, timings, {"alone": 3e-6, "kernels": 2}) == \
        pytest.approx(1e-6)
    assert kernel_mix.signature(seq) != kernel_mix.signature(seq[::-1])


def test_the_replay_adds_the_excess_to_each_cheap_kernel_only():
    """A chain of two cheap kernels, a wide one and an untimed op: the excess is added
    twice, never to the wide kernel (its chain includes its own hand-offs)."""
    a, wide = _kernel("A"), _kernel("W")
    flow = _flow([a, a, wide, None])
    timings = {a: {"alone": CHEAP, "shared": CHEAP},
               wide: {"alone": WIDE, "shared": 2 * WIDE}}
    costs = dict(op=0.0, handoff=0.0, hop=0.0, cold=None)
    plain = local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 1)
    mixed = local_step.replay(flow, timings, dict(costs, mix=1e-6), 0.0, 2, 1e9, 1)
    assert plain == pytest.approx(2 * CHEAP + WIDE)
    assert mixed - plain == pytest.approx(2e-6)


def _small_step():
    """A step's worth of small elementwise kernels and their gradients."""
    graph = tf.Graph()
    with graph.as_default():
        w = v1.get_variable("w", [8, 8], initializer=v1.ones_initializer())
        x = tf.constant(np.linspace(0.1, 1.0, 64).reshape(8, 8).astype(np.float32))
        h = tf.tanh(x * w) + tf.sqrt(tf.square(x - w) + 1.0)
        loss = tf.reduce_sum(h / (1.0 + tf.exp(-h)))
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph, train_op


def test_the_probe_runs_the_kernels_one_after_another_and_is_cached(tmp_path, monkeypatch):
    """Every kernel of the sequence is rebuilt on constant inputs and run; the result
    (seconds per kernel, how many ran) is cached under the sequence's digest beside the
    kernels' timings and read back rather than measured again."""
    graph, train_op = _small_step()
    ops = step_graph.optimized_step(graph, train_op)()
    seq = [s for s in (product_timing.kernel_signature(op, None) for op in ops) if s]
    assert len(seq) >= 8
    path = str(tmp_path / "kernels.json")
    calls = []
    real = kernel_mix.measure

    def counted(s, cores):
        calls.append(len(s))
        return real(s, cores)
    monkeypatch.setattr(kernel_mix, "measure", counted)
    probe = kernel_mix.timed(seq, 1, path)
    assert probe["kernels"] == len(seq) and probe["alone"] >= 0.0
    assert probe["alone"] < 1e-3                    # microseconds, not a whole step
    assert kernel_mix.timed(seq, 1, path) == probe and calls == [len(seq)]
    assert product_timing.cached_timings(path)[kernel_mix.signature(seq)] == probe
    assert kernel_mix.timed(seq[:1], 1, path) is None      # nothing to set apart


def test_local_step_probes_the_models_step_only_when_given(tmp_path, monkeypatch):
    """``local_step.timed`` prices the excess from the model's one-device step where the
    predictor hands it one (a replayed layout), and adds nothing otherwise."""
    a = _kernel("A")
    step = _flow([a, a, a])
    monkeypatch.setattr(product_timing, "timed", lambda sigs, cores, path=None: dict(
        (s, {"alone": CHEAP, "shared": CHEAP}) for s in sigs))
    monkeypatch.setattr(kernel_mix, "timed", lambda seq, cores, path=None: {
        "alone": CHEAP + 1e-6, "kernels": len(seq)})
    assert local_step.timed({a}, 2, 0.0)[1]["mix"] == 0.0
    assert local_step.timed({a}, 2, 0.0, step)[1]["mix"] == pytest.approx(1e-6)
