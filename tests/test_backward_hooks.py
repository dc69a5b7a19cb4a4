"""The registry of backward-pass hooks (epl.capture.backward_hooks): order, refusals, and the
hooks EPL's features register (issue 25)."""
import pytest

import tensorflow.compat.v1 as tf

import epl
from epl.capture import backward_hooks


class _Hook(backward_hooks.BackwardHook):
    def __init__(self, name, after=(), log=None, on=True):
        self.name, self.after, self.log, self.on = name, tuple(after), log, on

    def applies(self, call):
        return self.on

    def prepare(self, call):
        self.log.append(("prepare", self.name))

    def wrap(self, call, compute):
        def run():
            self.log.append(("enter", self.name))
            out = compute()
            self.log.append(("leave", self.name))
            return out
        return run

    def finish(self, call, result, recompute):
        self.log.append(("finish", self.name))


def _names(hooks):
    return [h.name for h in hooks]


def test_order_follows_after_not_registration():
    r = backward_hooks.Registry()
    r.register(_Hook("c", after=("b",)))
    r.register(_Hook("b", after=("a",)))
    r.register(_Hook("a"))
    assert _names(r.order()) == ["a", "b", "c"]


def test_ties_broken_by_name_whatever_the_import_order():
    for names in (["x", "m", "a"], ["a", "m", "x"], ["m", "x", "a"]):
        r = backward_hooks.Registry()
        for n in names:
            r.register(_Hook(n, after=("a",) if n != "a" else ()))
        assert _names(r.order()) == ["a", "m", "x"]


def test_unknown_name_refused_naming_it():
    r = backward_hooks.Registry()
    r.register(_Hook("gc", after=("amp", "nosuch")))
    r.register(_Hook("amp"))
    with pytest.raises(ValueError, match=r"'gc' runs after 'nosuch', which no module registered"):
        r.order()


def test_cycle_refused_naming_the_hooks():
    r = backward_hooks.Registry()
    r.register(_Hook("a", after=("c",)))
    r.register(_Hook("b", after=("a",)))
    r.register(_Hook("c", after=("b",)))
    r.register(_Hook("free"))
    with pytest.raises(ValueError, match=r"backward hooks \['a', 'b', 'c'\] .*cycle"):
        r.order()


def test_duplicate_name_refused_and_order_recomputed():
    r = backward_hooks.Registry()
    a = r.register(_Hook("a"))
    r.register(a)    # the same hook again: no change
    with pytest.raises(ValueError, match="'a' is already registered"):
        r.register(_Hook("a"))
    with pytest.raises(ValueError, match="needs a name"):
        r.register(_Hook(None))
    assert _names(r.order()) == ["a"]
    r.register(_Hook("b", after=("a",)))
    assert _names(r.order()) == ["a", "b"]
    r.unregister("a")
    with pytest.raises(ValueError, match="no module registered"):
        r.order()


def test_active_keeps_order_and_skips_hooks_that_do_not_apply():
    r = backward_hooks.Registry()
    r.register(_Hook("a"))
    r.register(_Hook("b", after=("a",), on=False))
    r.register(_Hook("c", after=("b",)))
    assert _names(r.active(None)) == ["a", "c"]


def test_the_features_register_in_their_declared_order():
    """AMP rebuilds the forward pass first, the stages are cut from it, gradient
    checkpointing works on the result (the order capture ran them in before the
    registry)."""
    names = _names(backward_hooks.order())
    for name in ("amp", "auto_stages", "gradient_checkpoint"):
        assert name in names
    assert names.index("amp") < names.index("auto_stages") < names.index("gradient_checkpoint")


def test_a_registered_hook_runs_around_a_user_backward_pass():
    """The capture hook runs every part of an applying hook, in order, around a user's
    tf.gradients call: prepare before, wrap inside (first hook outermost), finish after;
    the hook can change the call's arguments (grad_ys) and the gradients; and none of
    it for a call EPL builds while rewriting."""
    log = []

    class Scale(_Hook):
        def prepare(self, call):
            super(Scale, self).prepare(call)
            call.arguments["grad_ys"] = [tf.constant(3.0)]

        def wrap(self, call, compute):
            inner = super(Scale, self).wrap(call, compute)
            return lambda: [g * 2.0 for g in inner()]

    first = Scale("test_first", log=log)
    second = _Hook("test_second", after=("test_first",), log=log)
    backward_hooks.register(second)
    backward_hooks.register(first)
    try:
        epl.init()
        x = tf.constant(2.0)
        y = x * x
        g = tf.gradients(y, x)[0]
        assert log == [("prepare", "test_first"), ("prepare", "test_second"),
                       ("enter", "test_first"), ("enter", "test_second"),
                       ("leave", "test_second"), ("leave", "test_first"),
                       ("finish", "test_first"), ("finish", "test_second")]
        with tf.Session() as sess:
            assert sess.run(g) == pytest.approx(2 * 3.0 * 2 * 2.0)
        del log[:]
        from epl.ir import capture_context
        with capture_context.rewriting():
            tf.gradients(y, x)
        assert log == []
    finally:
        backward_hooks.REGISTRY.unregister("test_first")
        backward_hooks.REGISTRY.unregister("test_second")
