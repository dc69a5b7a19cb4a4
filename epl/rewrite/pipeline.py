"""The rewrite as a pipeline of named passes, run by one driver.

Each pass is one function ``run(ctx)`` over the ``PassContext`` the driver makes for it:
its view of the plan (``ctx.state``, a ``state.PassState``), the selection being copied,
the op id it starts after, whether this is the graph's first rewrite, and the products
its contract names.  A pass declares the facts and products it ``requires`` (reads),
``extends`` (adds to, made by an earlier pass) and ``provides`` (makes):
"replicas_cloned", "clone_maps", "templates"...  The driver refuses an order in which a
pass would run before what it needs, so a pass can be moved, added or disabled without
reading every other one, and hands a pass only the products it names (``ctx.product``,
``ctx.make``; another raises ``UndeclaredProduct``).  Products made with ``kept=True``
live as long as the graph's ``Rewrite`` (the clone maps, the inputs already sharded...);
the others are dropped when the run ends (the NodeDef templates).  Passes marked
``first_only`` run on the graph's first rewrite, not when ops added later are rewritten.

The driver times every pass (``PassPipeline.seconds``, logged at debug level) and, when
the environment variable ``EPL_DUMP_PASSES`` names a folder, writes the graph after each
pass there as ``<n>_<pass>.pbtxt`` (first rewrite) for reading or diffing.
"""
import logging
import os
import time

from epl.rewrite.state import CLONE_MAPS, PassState, UndeclaredProduct

log = logging.getLogger("epl")

DUMP_ENV = "EPL_DUMP_PASSES"


class Pass(object):
    """One named graph edit and its contract."""

    def __init__(self, name, run, requires=(), provides=(), first_only=False, doc="",
                 extends=()):
        self.name = name
        self.run = run
        self.extends = frozenset(extends)       # products it adds to (an earlier pass's)
        self.requires = frozenset(requires) | self.extends
        self.provides = frozenset(provides)
        self.first_only = first_only
        self.doc = doc

    def __repr__(self):
        return "Pass(%r)" % self.name


class PassContext(object):
    """What a rewrite hands the driver: ``rewrite`` (a ``state.Rewrite``: the plan and the
    products kept across rewrites; None for a pipeline of passes that read nothing), the
    selection being copied (all, or the ops made after ``since``), ``since``, whether this
    is the graph's first rewrite.  The driver gives each pass ``for_pass(p)``."""

    def __init__(self, rewrite, selection, since, first):
        self.rewrite = rewrite
        self.selection = selection
        self.since = since
        self.first = first
        self.run_products = {}      # products of this run only (dropped when it ends)
        self.allowed = None         # (a pass's context: the names its contract gives)
        self.pass_name = None
        self.state = None

    def for_pass(self, p):
        """The context of pass ``p``: its view of the plan, the products it names."""
        ctx = PassContext(self.rewrite, self.selection, self.since, self.first)
        ctx.run_products = self.run_products
        ctx.allowed = p.requires | p.provides
        ctx.pass_name = p.name
        if self.rewrite is not None:
            maps = self.rewrite.products.get(CLONE_MAPS) if CLONE_MAPS in ctx.allowed else None
            ctx.state = PassState(self.rewrite.plan, self.since, maps, p.name,
                                  writes_maps=CLONE_MAPS in (p.extends | p.provides))
        return ctx

    def _check(self, name):
        if self.allowed is not None and name not in self.allowed:
            raise UndeclaredProduct(
                "EPL rewrite: pass %r uses the product %r, which its contract does not "
                "name (requires %s)" % (self.pass_name, name, sorted(self.allowed)))

    def product(self, name):
        """The product ``name`` an earlier pass (or rewrite) made."""
        self._check(name)
        if name in self.run_products:
            return self.run_products[name]
        return self.rewrite.products[name]

    def make(self, name, factory, kept=False):
        """The product ``name`` this pass provides: made by ``factory()`` (or the one
        an earlier rewrite made and kept: ``kept=True`` products live with the graph)."""
        self._check(name)
        store = self.rewrite.products if kept else self.run_products
        if name not in store:
            store[name] = factory()
        return store[name]


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
            p.run(ctx.for_pass(p))
            self.seconds[p.name] = time.time() - start
            if ctx.first:
                self.first_spans.append((p.name, start, start + self.seconds[p.name]))
            if dump_dir and ctx.first:
                _dump(ctx.rewrite.graph, dump_dir, "%02d_%s" % (i, p.name))
        log.debug("EPL rewrite passes (s): %s",
                  ", ".join("%s %.3f" % (n, s) for n, s in self.seconds.items()))
        return dict(self.seconds)


def _dump(graph, folder, name):
    import tensorflow as tf
    os.makedirs(folder, exist_ok=True)
    tf.io.write_graph(graph.as_graph_def(), folder, name + ".pbtxt", as_text=True)
