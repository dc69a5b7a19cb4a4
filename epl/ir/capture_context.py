"""What EPL is doing in this thread while ops are made: the capture contexts.

The capture hooks (``epl.capture.ops``) classify every new op by these flags: ops made
inside ``rewriting()`` are EPL's own, inside ``creating_for(tg, phase)`` they belong to a
TaskGraph EPL builds for, and so on.  The flags live here, below the hooks and the
features that set them (AMP, gradient checkpointing, the cloner...), so those never
import the hooks to say what they are doing.
"""
import contextlib
import threading

_ctx = threading.local()


def state():
    """This thread's capture flags."""
    if not hasattr(_ctx, "grad_ops"):
        _ctx.grad_ops = []      # forward ops whose gradients are being built
        _ctx.grad_default = []  # TaskGraph of the loss of each tf.gradients call
        _ctx.apply = []         # TaskGraph of each apply_gradients call in progress
        _ctx.apply_depth = 0
        _ctx.save = 0
        _ctx.rewriting = 0
        _ctx.forced = []        # (TaskGraph, phase) EPL creates an op for (epl.capture.rebatch)
        _ctx.dense = []         # observers of Dense layers (observing_dense)
    return _ctx


@contextlib.contextmanager
def pushed(stack, item):
    stack.append(item)
    try:
        yield
    finally:
        stack.pop()


def creating_for(taskgraph, phase):
    """Ops created inside belong to ``taskgraph`` in ``phase`` (EPL builds them on the
    user's behalf while the user builds the graph)."""
    return pushed(state().forced, (taskgraph, phase))


def observing_dense(observer):
    """Inside, ``observer.building(layer, input_shape)`` runs before every Dense layer
    builds its variables and ``observer.called(layer)`` after each of its calls (the
    strategy search opens ``epl.split`` around a model's head this way)."""
    return pushed(state().dense, observer)


@contextlib.contextmanager
def rewriting():
    """Ops created inside are EPL's own (phase REWRITE), not the user's."""
    c = state()
    c.rewriting += 1
    try:
        yield
    finally:
        c.rewriting -= 1
