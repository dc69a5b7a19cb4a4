"""The rewrite as a pipeline of named passes, run by one driver.

Each pass is one function ``run(ctx)`` over a ``PassContext`` (the shared
``ReplicaState``, the selection being copied, the op id it starts after, whether this is
the graph's first rewrite).  A pass declares the facts it ``requires`` and ``provides``
("replicas_cloned", "pipeline_scheduled"...): the driver refuses an order in which a pass
would run before what it needs, so a pass can be moved, added or disabled without
reading every other one.  Passes marked ``first_only`` run on the graph's first rewrite,
not when ops added later are rewritten.

The driver times every pass (``PassPipeline.seconds``, logged at debug level) and, when
the environment variable ``EPL_DUMP_PASSES`` names a folder, writes the graph after each
pass there as ``<n>_<pass>.pbtxt`` (first rewrite) for reading or diffing.
"""
import logging
import os
import time

log = logging.getLogger("epl")

DUMP_ENV = "EPL_DUMP_PASSES"


class Pass(object):
    """One named graph edit and its contract."""

    def __init__(self, name, run, requires=(), provides=(), first_only=False, doc=""):
        self.name = name
        self.run = run
        self.requires = frozenset(requires)
        self.provides = frozenset(provides)
        self.first_only = first_only
        self.doc = doc

    def __repr__(self):
        return "Pass(%r)" % self.name


class PassContext(object):
    """What every pass sees."""

    def __init__(self, state, selection, since, first):
        self.state = state          # rewrite.state.ReplicaState
        self.selection = selection  # the ops being copied (all, or those made after since)
        self.since = since          # op id the ops being rewritten come after (-1: all)
        self.first = first          # the graph's first rewrite


class PassOrderError(ValueError):
    pass


class PassPipeline(object):
    """Passes in order, checked against their contracts when built."""

    def __init__(self, passes, given=()):
        self.passes = list(passes)
        self.seconds = {}
        self.first_spans = []   # (pass, start, end) wall times of a first rewrite (epl.profile)
        have = set(given)
        names = set()
        for p in self.passes:
            if p.name in names:
                raise PassOrderError("pass %r appears twice" % p.name)
            names.add(p.name)
            missing = p.requires - have
            if missing:
                raise PassOrderError(
                    "pass %r requires %s, which no earlier pass provides (order: %s)"
                    % (p.name, sorted(missing), [q.name for q in self.passes]))
            have |= p.provides

    def names(self):
        return [p.name for p in self.passes]

    def run(self, ctx, dump_dir=None):
        """Run every pass that applies to ``ctx`` in order; returns this run's seconds per
        pass."""
        dump_dir = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV)
        self.seconds = {}
        if ctx.first:
            self.first_spans = []
        for i, p in enumerate(self.passes):
            if p.first_only and not ctx.first:
                continue
            start = time.time()
            p.run(ctx)
            self.seconds[p.name] = time.time() - start
            if ctx.first:
                self.first_spans.append((p.name, start, start + self.seconds[p.name]))
            if dump_dir and ctx.first:
                _dump(ctx.state.graph, dump_dir, "%02d_%s" % (i, p.name))
        log.debug("EPL rewrite passes (s): %s",
                  ", ".join("%s %.3f" % (n, s) for n, s in self.seconds.items()))
        return dict(self.seconds)


def _dump(graph, folder, name):
    import tensorflow as tf
    os.makedirs(folder, exist_ok=True)
    tf.io.write_graph(graph.as_graph_def(), folder, name + ".pbtxt", as_text=True)
