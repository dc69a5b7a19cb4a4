"""The registry of backward-pass hooks: features that change a user's backward pass.

A feature that changes how the gradients of a user's ``tf.gradients`` /
``GradientTape.gradient`` call are built (automatic stages, AMP, gradient
checkpointing) registers a :class:`BackwardHook` here when its module is imported,
with the hooks it must run after.  The capture hook (``epl.capture.backward``) asks
:func:`active` for the hooks that apply to a call, in that order, and runs their three
parts around the call; it names no feature, so a new one is one ``register`` call in
its own module, with its own ordering constraint.

Order: ``after`` names the hooks that run before this one (every part: ``prepare``
first, the outermost ``wrap``, ``finish`` first).  The order is the topological order
of those constraints, ties broken by name (so it does not depend on which module was
imported first); an unknown name or a cycle is refused when the order is asked for,
naming the hooks (``epl.capture.hook_order``, shared with the apply-path hooks).
"""
from epl.capture import hook_order


class BackwardHook(object):
    """A feature's part in every user backward pass (subclass and override).

    ``name``: the hook's name in ``after`` lists.  ``after``: names of the hooks
    this one runs after.  ``needs_gradients_call``: a graph-mode tape's gradient is
    computed through ``tf.gradients`` while this hook applies (AMP: its half-precision
    rebuild and loss scaling are written for that call)."""

    name = None
    after = ()
    needs_gradients_call = False

    def applies(self, call):
        """This hook changes ``call`` (a :class:`BackwardCall`); default: never."""
        return False

    def prepare(self, call):
        """Before the gradients are built, outside the backward phase (ops made here
        are not the call's)."""

    def wrap(self, call, compute):
        """A function computing the gradients in place of ``compute()`` (inside the
        backward phase: ops made there are the call's backward ops)."""
        return compute

    def finish(self, call, result, recompute):
        """After the gradients ``result`` are built (``recompute()`` builds them again,
        through every hook's ``wrap``)."""


class BackwardCall(object):
    """One user backward pass being built: what the hooks read and share.

    ``kind``: "gradients" (tf.gradients; its arguments can be changed through
    ``arguments``) or "tape" (GradientTape.gradient).  ``ys``: the tensors whose
    gradients are built (flattened); ``first_id``: the id of the first op the call
    builds, set before ``wrap``'s functions run; ``scratch``: each hook's own values
    for this call, by hook name."""

    def __init__(self, kind, graph, ys, xs, config, bind=None):
        self.kind = kind
        self.graph = graph
        self.ys = ys
        self.xs = xs
        self.config = config
        self.first_id = None
        self.scratch = {}
        self._bind = bind
        self.bound = None

    @property
    def arguments(self):
        """tf.gradients' arguments by name (a hook may change them: ``grad_ys``,
        ``stop_gradients``); bound on first use, so a call no hook edits is made with
        the user's arguments as they came."""
        if self._bind is None:
            raise TypeError("a %s call has no tf.gradients arguments" % self.kind)
        if self.bound is None:
            self.bound = self._bind()
        return self.bound.arguments


class Registry(hook_order.Registry):
    """Backward hooks by name, and their order (``epl.capture.hook_order``)."""

    kind = "backward hook"


# The process's registry: features register here when imported.
REGISTRY = Registry()
register = REGISTRY.register
order = REGISTRY.order
active = REGISTRY.active
