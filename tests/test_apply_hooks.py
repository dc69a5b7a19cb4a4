"""The registry of apply-path hooks (epl.capture.apply_hooks): order, refusals, the hooks
EPL's features register, and the order the capture runs them in (issue 34)."""
import numpy as np
import pytest

import tensorflow.compat.v1 as tf

import epl
from epl import ir
from epl.capture import apply_hooks


class _Hook(apply_hooks.ApplyHook):
    def __init__(self, name, after=(), log=None, on=True):
        self.name, self.after, self.log, self.on = name, tuple(after), log, on

    def applies(self, call):
        return self.on

    def prepare(self, call):
        self.log.append(("prepare", self.name))

    def wrap(self, call, apply):
        def run(grads_and_vars):
            self.log.append(("enter", self.name))
            out = apply(grads_and_vars)
            self.log.append(("leave", self.name))
            return out
        return run

    def finish(self, call):
        self.log.append(("finish", self.name))


def _names(hooks):
    return [h.name for h in hooks]


def test_order_follows_after_not_registration_nor_name():
    r = apply_hooks.Registry()
    r.register(_Hook("a", after=("m",)))
    r.register(_Hook("m", after=("z",)))
    r.register(_Hook("z"))
    assert _names(r.order()) == ["z", "m", "a"]


def test_ties_broken_by_name_whatever_the_import_order():
    for names in (["x", "m", "a"], ["a", "m", "x"], ["m", "x", "a"]):
        r = apply_hooks.Registry()
        for n in names:
            r.register(_Hook(n, after=("a",) if n != "a" else ()))
        assert _names(r.order()) == ["a", "m", "x"]


def test_unknown_name_refused_naming_it():
    r = apply_hooks.Registry()
    r.register(_Hook("grouped", after=("amp", "nosuch")))
    r.register(_Hook("amp"))
    with pytest.raises(ValueError, match=r"apply hook 'grouped' runs after 'nosuch', which no "
                                         r"module registered"):
        r.order()


def test_cycle_refused_naming_the_hooks():
    r = apply_hooks.Registry()
    r.register(_Hook("a", after=("c",)))
    r.register(_Hook("b", after=("a",)))
    r.register(_Hook("c", after=("b",)))
    r.register(_Hook("free"))
    with pytest.raises(ValueError, match=r"apply hooks \['a', 'b', 'c'\] .*cycle"):
        r.order()


def test_duplicate_name_refused():
    r = apply_hooks.Registry()
    a = r.register(_Hook("a"))
    r.register(a)
    with pytest.raises(ValueError, match="an apply hook named 'a' is already registered"):
        r.register(_Hook("a"))
    with pytest.raises(ValueError, match="an apply hook needs a name"):
        r.register(_Hook(None))


def test_the_features_register_in_their_declared_order():
    """The order the capture ran them in before the registry: sparse gradients made
    dense before anything sees them, accumulation's gate outside AMP's, grouped apply
    on the ops both built."""
    names = _names(apply_hooks.order())
    for name in ("sparse_as_dense", "accumulate", "amp", "grouped_apply"):
        assert name in names
    assert names.index("sparse_as_dense") < names.index("accumulate") < names.index("amp") \
        < names.index("grouped_apply")


def _model():
    x = tf.constant([[1.0, 2.0]])
    w = tf.get_variable("w", initializer=tf.constant([[0.5], [0.25]]))
    loss = tf.reduce_sum(tf.matmul(x, w))
    return w, loss


def test_registered_hooks_run_in_their_order_around_a_user_apply():
    """Every part of each applying hook runs, in the registry's order (not registration
    order, not name order): prepare before the apply phase, wrap inside it (first hook
    outermost: its pairs are what the next one gets), finish after; the prepared pairs
    are what the record keeps; a hook that does not apply runs nothing; a nested call
    (an override calling the base method) runs them once."""
    log = []

    class Double(_Hook):
        def prepare(self, call):
            super(Double, self).prepare(call)
            call.grads_and_vars = [(g * 2.0, v) for g, v in call.grads_and_vars]

        def wrap(self, call, apply):
            inner = super(Double, self).wrap(call, apply)
            return lambda gvs: inner([(g * 3.0, v) for g, v in gvs])

        def finish(self, call):
            super(Double, self).finish(call)
            log.append(("result", call.result.name, call.first_id is not None))

    first = Double("z_test_first", log=log)
    second = _Hook("a_test_second", after=("z_test_first",), log=log)
    off = _Hook("m_test_off", log=log, on=False)
    for h in (second, off, first):
        apply_hooks.register(h)
    try:
        epl.init()
        w, loss = _model()

        class Override(tf.train.GradientDescentOptimizer):
            def apply_gradients(self, grads_and_vars, global_step=None, name=None):
                return super(Override, self).apply_gradients(grads_and_vars, global_step, name)

        train = Override(0.1).minimize(loss)
        assert log == [("prepare", "z_test_first"), ("prepare", "a_test_second"),
                       ("enter", "z_test_first"), ("enter", "a_test_second"),
                       ("leave", "a_test_second"), ("leave", "z_test_first"),
                       ("finish", "z_test_first"), ("result", train.name, True),
                       ("finish", "a_test_second")]
        records = ir.Graph.get(tf.get_default_graph()).apply_records
        assert len(records) == 1 and records[0].result is train
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            recorded = sess.run(records[0].grads_and_vars[0][0])
            sess.run(train)
            got = sess.run(w)
        # d loss / d w = x^T = [1, 2]; doubled in prepare (recorded), tripled in wrap.
        np.testing.assert_allclose(recorded, [[2.0], [4.0]])
        np.testing.assert_allclose(got, [[0.5 - 0.1 * 6.0], [0.25 - 0.1 * 12.0]], rtol=1e-6)
    finally:
        for h in (first, second, off):
            apply_hooks.REGISTRY.unregister(h.name)


def test_a_cycle_among_registered_hooks_stops_the_apply_naming_them():
    a = _Hook("test_cycle_a", after=("test_cycle_b",), log=[])
    b = _Hook("test_cycle_b", after=("test_cycle_a",), log=[])
    apply_hooks.register(a)
    apply_hooks.register(b)
    try:
        epl.init()
        _, loss = _model()
        with pytest.raises(ValueError, match=r"\['test_cycle_a', 'test_cycle_b'\] .*cycle"):
            tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    finally:
        apply_hooks.REGISTRY.unregister(a.name)
        apply_hooks.REGISTRY.unregister(b.name)
    assert "test_cycle_a" not in _names(apply_hooks.order())


@pytest.mark.parametrize("as_dense", [False, True])
def test_sparse_as_dense_is_what_the_optimizer_and_the_record_get(as_dense):
    epl.init(epl.Config({"communication.sparse_as_dense": as_dense}))
    table = tf.get_variable("table", initializer=tf.ones([4, 2]))
    loss = tf.reduce_sum(tf.nn.embedding_lookup(table, tf.constant([0, 2])))
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    record = ir.Graph.get(tf.get_default_graph()).apply_records[-1]
    grad = record.grads_and_vars[0][0]
    assert isinstance(grad, tf.IndexedSlices) != as_dense, grad


def test_accumulation_marks_the_record_across_runs():
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    _, loss = _model()
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert ir.Graph.get(tf.get_default_graph()).apply_records[-1].across_runs
