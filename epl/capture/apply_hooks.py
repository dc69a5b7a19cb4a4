"""The registry of apply-path hooks: features that change a user's ``apply_gradients``.

A feature that changes what an optimizer's ``apply_gradients`` call gets, builds or
returns (``sparse_as_dense``, accumulation across runs, AMP's overflow skip, grouped
apply) registers an :class:`ApplyHook` here when its module is imported, with the hooks
it must run after.  The capture hook (``epl.capture.apply``) names no feature: for each
user call (not a nested one, not while EPL is not initialized) it runs, in this
registry's order,

::

  applies, then prepare (each hook       before the apply phase: may replace
    in order; a hook is asked after        call.grads_and_vars (what the optimizer gets
    the previous one prepared)             and what the ApplyRecord keeps), set
                                           call.across_runs, refuse the call
  first_id = next op id
  [ wrap(wrap(optimizer)) ](pairs)       inside the apply phase (first hook outermost):
                                           a wrap may give the inner apply other pairs
                                           and return another op than it did
  finish (each hook, in order)           after the apply phase, the call's ops built
                                           (ids call.first_id.., call.result)
  ApplyRecord(pairs, global_step, across_runs, op ids, result)

Order: ``after`` names the hooks that run before this one (every part).  The order is
the topological order of those constraints, ties by name; an unknown name or a cycle is
refused when the order is first asked for, naming the hooks (``epl.capture.hook_order``).
"""
from epl import ir
from epl.capture import hook_order


class ApplyHook(object):
    """A feature's part in every user ``apply_gradients`` call (subclass and override).

    ``name``: the hook's name in ``after`` lists.  ``after``: names of the hooks this
    one runs after."""

    name = None
    after = ()

    def applies(self, call):
        """This hook changes ``call`` (an :class:`ApplyCall`); default: never."""
        return False

    def prepare(self, call):
        """Before the apply phase (ops made here are not the call's apply ops): may
        replace ``call.grads_and_vars``, set ``call.across_runs``, or refuse the call."""

    def wrap(self, call, apply):
        """A function of the (gradient, variable) pairs that builds the update in place
        of ``apply(pairs)`` and returns the op to hand back; it runs inside the apply
        phase (``wrap`` itself is called before it and builds nothing)."""
        return apply

    def finish(self, call):
        """After the apply phase: the call's ops (ids ``call.first_id``..) and its
        result (``call.result``) are built."""


class ApplyCall(object):
    """One user ``apply_gradients`` call being built: what the hooks read and share.

    ``grads_and_vars``: the (gradient, variable) pairs (a list; a ``prepare`` may
    replace it); ``global_step`` as given (None for a keras optimizer);
    ``across_runs``: the update applies gradients accumulated across session runs (set
    by the hook that accumulates; the rewrite reads it from the record);
    ``first_id``: the id of the first op of the apply phase, set before the ``wrap``
    functions run; ``result``: the op the call returns, set before ``finish``;
    ``scratch``: each hook's own values for this call, by hook name."""

    def __init__(self, graph, grads_and_vars, global_step, config):
        self.graph = graph
        self.epl_graph = ir.Graph.get(graph)
        self.grads_and_vars = list(grads_and_vars)
        self.global_step = global_step
        self.config = config
        self.across_runs = False
        self.first_id = None
        self.result = None
        self.scratch = {}


class Registry(hook_order.Registry):
    """Apply hooks by name, and their order (``epl.capture.hook_order``)."""

    kind = "apply hook"


# The process's registry: features register here when imported.
REGISTRY = Registry()
register = REGISTRY.register
order = REGISTRY.order
