"""Control flow v1 (tf.cond, tf.while_loop and their gradients) in copied replicas.

Why a module: a v1 loop or condition is not one op but many (``Enter`` / ``Switch`` /
``Merge`` / ``Exit`` / ``NextIteration``) tied together by two things the cloner's
NodeDef copies do not carry by themselves, handled here.

* Frames.  TensorFlow runs a v1 loop as a frame named by its ``Enter`` ops'
  ``frame_name``; two loops with one frame name would run as one.  A clone's copy of a
  loop therefore gets the frame name ``EPL_REPLICA_<c>/<name>`` (``frame_attr``, set on
  its NodeDefs by the cloner).
* Contexts.  The Python side of control flow lives in the graph's control-flow
  contexts (``WhileContext`` / ``CondContext``): every op knows its context, and the
  graph's WHILE_CONTEXT / COND_CONTEXT collections hold the outermost ones, which
  ``export_meta_graph`` serializes.  ``copy_contexts`` (the ``copy_loop_contexts``
  pass) builds each clone's contexts from the originals' protos with every name sent to
  the clone's copy, so the copies' contexts are as valid as the user's.

Control edges a rewrite adds (the pipeline schedule, a replica's micro-batch order)
must stay clear of loops and conditions: ``edge_safe`` says which ops they may touch.
"""
import tensorflow as tf

from epl.tf_adapter import contexts
from epl.tf_adapter import graph as tfg

_COLLECTIONS = (tf.compat.v1.GraphKeys.WHILE_CONTEXT, tf.compat.v1.GraphKeys.COND_CONTEXT)


def context_of(op):
    return tfg.control_flow_context(op)


def root_of(ctx):
    while ctx.outer_context is not None:
        ctx = ctx.outer_context
    return ctx


def describe(ctx):
    """A user's name for a context: 'the tf.while_loop rnn/while'."""
    if contexts.is_loop(ctx):
        kind, name = "tf.while_loop", ctx.name
        if name.endswith("/while_context"):
            name = name[:-len("/while_context")]
    else:
        kind, name = "tf.cond", ctx.name
        for suffix in ("/cond_text", "/cond_text_1"):
            if name.endswith(suffix):
                name = name[:-len(suffix)]
    return "the %s %r" % (kind, name)


def roots_of(ops):
    """The outermost contexts of ``ops``, in the order their first op appears."""
    roots = {}
    for op in ops:
        ctx = context_of(op)
        if ctx is not None:
            roots.setdefault(root_of(ctx), None)
    return list(roots)


def copy_contexts(state, ops, copied):
    """Give clone c's copies of ``ops`` contexts like the originals'.  ``copied``:
    roots already copied by an earlier rewrite (updated)."""
    roots = roots_of(ops)
    again = [r for r in roots if r in copied]
    if again:
        raise RuntimeError(
            "EPL: ops were added to %s after the graph was rewritten for %d clones; build "
            "the whole loop or condition before the first session.run."
            % (describe(again[0]), state.num_clones))
    if not roots:
        return
    g = state.graph
    members = {}
    for key in _COLLECTIONS:
        for ctx in g.get_collection(key):
            members.setdefault(ctx, []).append(key)
    with g.as_default():
        for root in roots:
            copied.add(root)
            proto = root.to_proto()
            for c in range(1, state.num_clones):
                new = _rebuild(state, c, proto)
                for key in members.get(root, []):
                    g.add_to_collection(key, new)


def _rebuild(state, c, proto):
    names = _Renamer(state, c)
    copy = type(proto)()
    copy.CopyFrom(proto)
    _rename_context(copy, names)
    return contexts.from_proto(copy)


class _Renamer(object):
    """Names of the user's graph -> names of clone c's copies (unchanged for what the
    clone shares: placeholders, shared variables, the step)."""

    def __init__(self, state, c):
        self.state = state
        self.c = c
        self.nodes = tfg.ops_by_name(state.graph)

    def op_name(self, name):
        op = self.nodes.get(name)
        if op is None:
            return name
        return self.state.op_name(self.c, op)

    def own(self, name):
        """Clone c has its own copy of this tensor's op (micro-batches share their
        replica's updates: those stay in the replica's contexts)."""
        if self.state.is_rep(self.c):
            return True
        op = self.nodes.get(name.split(":")[0])
        if op is None:
            return True
        return self.state.op(self.c, op) is not self.state.op(self.state.reps[self.c], op)

    def tensor(self, name):
        if not name:
            return name
        op, _, index = name.partition(":")
        return self.op_name(op) + (":" + index if index else "")

    def context(self, name):
        return self.state.clone_name(self.c, name)


def _rename_context(proto, names):
    proto.context_name = names.context(proto.context_name)
    if contexts.is_loop_proto(proto):
        for field in ("pivot_name", "pivot_for_pred_name", "pivot_for_body_name",
                      "maximum_iterations_name"):
            setattr(proto, field, names.tensor(getattr(proto, field)))
        for field in ("loop_exit_names", "loop_enter_names"):
            renamed = [names.tensor(n) for n in getattr(proto, field)]
            del getattr(proto, field)[:]
            getattr(proto, field).extend(renamed)
    else:
        proto.pred_name = names.tensor(proto.pred_name)
        proto.pivot_name = names.tensor(proto.pivot_name)
    values = proto.values_def
    external = dict(values.external_values)
    kept = [n for n in values.values if n in external or names.own(n)]
    del values.values[:]
    values.values.extend(names.tensor(n) for n in kept)
    values.external_values.clear()
    for k, v in external.items():
        values.external_values[names.tensor(k)] = names.tensor(v)
    for nested in proto.nested_contexts:
        inner = nested.while_ctxt if nested.HasField("while_ctxt") else nested.cond_ctxt
        _rename_context(inner, names)


def frame_attr(c, state, value):
    """An ``Enter`` op's frame name in clone c."""
    return tf.compat.v1.AttrValue(s=state.clone_name(c, value.s.decode()).encode())


CONTROL_FLOW_OPS = frozenset(["Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter",
                              "Exit", "RefExit", "NextIteration", "RefNextIteration",
                              "LoopCond", "ControlTrigger"])


def edge_safe(ops):
    """The ops of ``ops`` that control edges may touch: outside any loop or condition,
    not one of their primitives, and never dead.  An edge into a loop body, or out of
    it, is invalid; one from a dead op (downstream of a ``Switch`` branch not taken,
    before the ``Merge``: a condition's gradient has such ops outside its context)
    would make its target dead; and Grappler's constant folding turns a control edge
    from a ``Switch`` into a cycle."""
    dead = set()
    frontier = [op for op in ops if op.type in ("Switch", "RefSwitch")]
    while frontier:
        op = frontier.pop()
        for out in op.outputs:
            for nxt in out.consumers():
                if nxt not in dead and nxt.type not in _LIVE_AGAIN:
                    dead.add(nxt)
                    frontier.append(nxt)
        for nxt in tfg.control_outputs(op):
            if nxt not in dead and nxt.type not in _LIVE_AGAIN:
                dead.add(nxt)
                frontier.append(nxt)
    return set(op for op in ops if context_of(op) is None and op.type not in CONTROL_FLOW_OPS
               and op not in dead)


# A Merge is live when one input is; a loop's Exit when the loop ends.
_LIVE_AGAIN = frozenset(["Merge", "RefMerge", "Exit", "RefExit"])
