"""The registry of backward-pass hooks: features that change a user's backward pass.

A feature that changes how the gradients of a user's ``tf.gradients`` /
``GradientTape.gradient`` call are built (automatic stages, AMP, gradient
checkpointing) registers a :class:`BackwardHook` here when its module is imported,
with the hooks it must run after.  The capture hook (``epl.capture.patches``) asks
:func:`active` for the hooks that apply to a call, in that order, and runs their three
parts around the call; it names no feature, so a new one is one ``register`` call in
its own module, with its own ordering constraint.

Order: ``after`` names the hooks that run before this one (every part: ``prepare``
first, the outermost ``wrap``, ``finish`` first).  The order is the topological order
of those constraints, ties broken by name (so it does not depend on which module was
imported first); an unknown name or a cycle is refused when the order is asked for,
naming the hooks.
"""


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


class Registry(object):
    """Backward hooks by name, and their order."""

    def __init__(self):
        self._hooks = {}
        self._order = None

    def register(self, hook):
        """Add ``hook`` (a :class:`BackwardHook`); a second hook of the same name is
        refused.  Returns the hook."""
        if not hook.name or not isinstance(hook.name, str):
            raise ValueError("a backward hook needs a name (a str), got %r" % (hook.name,))
        if hook.name in self._hooks and self._hooks[hook.name] is not hook:
            raise ValueError("a backward hook named %r is already registered (%r); give the "
                             "new one another name" % (hook.name, self._hooks[hook.name]))
        self._hooks[hook.name] = hook
        self._order = None
        return hook

    def unregister(self, name):
        self._hooks.pop(name, None)
        self._order = None

    def order(self):
        """Every hook, each after those its ``after`` names (ties by name)."""
        if self._order is None:
            self._order = _topological(self._hooks)
        return list(self._order)

    def active(self, call):
        """The hooks that apply to ``call``, in order."""
        return [h for h in self.order() if h.applies(call)]


def _topological(hooks):
    for h in sorted(hooks.values(), key=lambda h: h.name):
        unknown = [n for n in h.after if n not in hooks]
        if unknown:
            raise ValueError(
                "backward hook %r runs after %s, which no module registered (registered: "
                "%s); import the feature that registers it, or fix the name"
                % (h.name, ", ".join(repr(n) for n in unknown), sorted(hooks)))
    waiting = {name: set(h.after) for name, h in hooks.items()}
    order = []
    while waiting:
        ready = sorted(n for n, deps in waiting.items() if not deps)
        if not ready:
            raise ValueError(
                "backward hooks %s each run after another of them (a cycle in their 'after' "
                "constraints): %s" % (sorted(waiting), "; ".join(
                    "%r after %s" % (n, sorted(deps)) for n, deps in sorted(waiting.items()))))
        first = ready[0]
        order.append(hooks[first])
        del waiting[first]
        for deps in waiting.values():
            deps.discard(first)
    return order


# The process's registry: features register here when imported.
REGISTRY = Registry()
register = REGISTRY.register
order = REGISTRY.order
active = REGISTRY.active
