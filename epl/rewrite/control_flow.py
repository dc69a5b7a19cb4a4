"""TF1 control flow (tf.cond, tf.while_loop and their gradients) in copied replicas.

TensorFlow runs a v1 loop as a frame named by its ``Enter`` ops' ``frame_name``;
two loops with one frame name would run as one.  A clone's copy of a loop
therefore gets the frame name ``EPL_REPLICA_<c>/<name>`` (set on its NodeDefs
by the cloner).  The Python side of control flow lives in the graph's
control-flow contexts (``WhileContext`` / ``CondContext``): every op knows its
context, and the graph's WHILE_CONTEXT / COND_CONTEXT collections hold the
outermost ones, which ``export_meta_graph`` serializes.  ``copy_contexts``
builds each clone's contexts from the originals' protos with every name sent to
the clone's copy, so the copies' contexts are as valid as the user's.

A loop or condition runs on one pipeline stage: one that spans two is refused
with its name (``check_stages``).

Control flow v2 (TF 2.x's ``disable_eager_execution()`` alone, or
``enable_control_flow_v2()``): a loop or condition is one op (``While`` / ``If`` and
their stateless forms) whose bodies are functions of the graph's library
(``epl.tf_adapter.functions``).  The cloner copies the op like any other; every copy
calls the same bodies, except where a copy needs bodies of its own
(``function_attr``): a body's colocation constraints name the clone (TensorFlow groups
colocated ops by those names across the whole graph, so two replicas' inlined bodies
would be tied to one device), its seeded random ops get the clone's seed stream, the
named resources it makes get the clone's names (as ``shared_name`` outside bodies),
and devices set inside a body are dropped (the body runs on its call op's device).  A
loop's gradient pushes the forward values it needs onto lists (TensorList
accumulators) that the forward ``While`` takes as extra inputs, made while the
gradient is built: capture counts them with the forward loop
(``ir.Graph.adopt_loop_inputs``).  A stage boundary inside a body is refused like a
v1 loop across stages, and so is a loop the clones copied that changed afterwards
(``check_calls_unchanged``).  An ``epl.split`` layer inside the body of a loop built
outside the split scope is refused (``check_split_scopes``): a split layer computes
on every replica's rows at once.
"""
import tensorflow as tf
from tensorflow.core.protobuf import control_flow_pb2
from tensorflow.python.ops import control_flow_ops

from epl import ir
from epl.tf_adapter import functions
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import VARIABLE_OPS

_COLLECTIONS = (tf.compat.v1.GraphKeys.WHILE_CONTEXT, tf.compat.v1.GraphKeys.COND_CONTEXT)


def context_of(op):
    return tfg.control_flow_context(op)


def root_of(ctx):
    while ctx.outer_context is not None:
        ctx = ctx.outer_context
    return ctx


def describe(ctx):
    """A user's name for a context: 'the tf.while_loop rnn/while'."""
    if isinstance(ctx, control_flow_ops.WhileContext):
        kind, name = "tf.while_loop", ctx.name
        if name.endswith("/while_context"):
            name = name[:-len("/while_context")]
    else:
        kind, name = "tf.cond", ctx.name
        for suffix in ("/cond_text", "/cond_text_1"):
            if name.endswith(suffix):
                name = name[:-len(suffix)]
    return "the %s %r" % (kind, name)


def check_stages(ir_graph, taskgraphs, num_stages):
    """Every loop and condition of a pipeline's forward ops is built in one stage's
    scope.  (Their gradients follow: ops that tf.gradients adds to a forward loop, like
    its iteration counter, may be attributed to the stage whose gradient was being
    built.)  Checked before the stages are ordered: a loop across stages reads in
    both directions.  Runs before the selection, for every layout, with the checks of
    split scopes around v2 loops (``check_split_scopes``).

    (What capture recorded of v2 control flow is corrected where it is recorded: ops
    of v2 bodies never join the graph's TaskGraphs (``ir.Graph.record``), and the
    accumulators a loop's gradient adds to the forward loop join the loop's TaskGraph
    at the end of the gradient call that made them (``ir.Graph.adopt_loop_inputs``).)"""
    check_split_scopes(ir_graph)
    if num_stages <= 1:
        return
    _check_function_stages(ir_graph, taskgraphs)
    stages = {}
    for tg in taskgraphs:
        for op in tg.ops:
            ctx = context_of(op)
            if ctx is None or ir_graph.phase_of(op) != ir.FORWARD:
                continue
            stages.setdefault(root_of(ctx), {}).setdefault(tg.index, (tg, op))
    for root, where in stages.items():
        if len(where) > 1:
            examples = ", ".join("%r in %s" % (op.name, tg.strategy)
                                 for _, (tg, op) in sorted(where.items()))
            what = "loop" if isinstance(root, control_flow_ops.WhileContext) else "condition"
            raise ValueError(
                "EPL: %s spans pipeline stages (%s). A loop or condition, with its body, "
                "must run on one stage: build the whole %s inside one stage's scope "
                "(epl.replicate), not a stage boundary inside its body."
                % (describe(root), examples, what))


def _body_strategies(graph, op, seen):
    """{strategy: an op name} of the forward ops built inside ``op``'s functions (nested
    loops and conditions too), from the IR of their Python graphs (None where a body
    has none: a graph imported from a GraphDef)."""
    out = {}
    for _, value in functions.function_attrs(op):
        for name in functions.attr_function_names(value):
            if name in seen:
                continue
            seen.add(name)
            for body in functions.source_graphs(graph, name):
                _add_strategies(graph, body, seen, out)
    return out


def _add_strategies(graph, body, seen, out):
    """Add the strategies recorded in the body graph ``body`` (and its nested calls)."""
    body_ir = ir.Graph.existing(body)
    if body_ir is not None:
        for inner in body.get_operations():
            tg = body_ir.taskgraph_of(inner)
            if tg is not None and body_ir.phase_of(inner) == ir.FORWARD:
                out.setdefault(tg.strategy, inner.name)
            if functions.is_call(inner):
                for s, n in _body_strategies(graph, inner, seen).items():
                    out.setdefault(s, n)


def describe_call(op):
    """A user's name for a v2 loop or condition: 'the tf.while_loop 'rnn/while''."""
    kind = {"loop": "tf.while_loop", "branch": "tf.cond"}.get(functions.CALL_OPS[op.type],
                                                             "function call")
    if op.type in ("Case", "StatelessCase"):
        kind = "tf.case / tf.switch_case"
    return "the %s %r" % (kind, op.name)


def _check_function_stages(ir_graph, taskgraphs):
    """A v2 loop or condition is one op, on its TaskGraph's stage: ops built inside its
    body under another stage's scope would silently run on the loop's stage.
    Refused like a v1 loop across stages."""
    stage_strategies = set(id(tg.strategy) for tg in taskgraphs)
    for tg in taskgraphs:
        for op in tg.ops:
            if not functions.is_call(op) or ir_graph.phase_of(op) != ir.FORWARD:
                continue
            inside = _body_strategies(op.graph, op, set())
            other = [(s, n) for s, n in inside.items()
                     if s is not tg.strategy and id(s) in stage_strategies]
            if not other:
                continue
            examples = ["%r in %s" % (op.name, tg.strategy)]
            examples += ["%r (inside its body) in %s" % (n, s) for s, n in other]
            if tg.strategy in inside:
                examples.append("%r (inside its body) in %s" % (inside[tg.strategy],
                                                                tg.strategy))
            what = "loop" if functions.CALL_OPS[op.type] == "loop" else "condition"
            raise ValueError(
                "EPL: %s spans pipeline stages (%s). A loop or condition, with its body, "
                "must run on one stage: build the whole %s inside one stage's scope "
                "(epl.replicate), not a stage boundary inside its body."
                % (describe_call(op), ", ".join(sorted(examples, key=_stage_key)), what))


def check_split_scopes(ir_graph):
    """An ``epl.split`` scope and the v2 loops and conditions it meets, checked before
    the first step (``check_stages`` runs it for every layout).

    * A split layer inside the body of a loop or condition built outside the split
      scope is refused: the body runs once per replica, inside that replica's call op,
      while a split layer computes on every replica's rows at once (its rows cross
      between the replicas outside any loop); the loop's lists of forward values would
      meet rows of the wrong count.  Built inside the scope, the whole loop is the
      split's.
    * Where a v2 loop runs on the device of every variable it captures (TF 1.15 lowers
      it into nodes tied to them), a loop of a split scope whose body reads the shards
      of split variables (on several devices) cannot be placed: refused.
    * A v2 loop or condition of a scope that runs on another number of rows than it
      is built for (``epl.capture.rebatch``: a split scope, ``replicate(k > 1)``) whose input
      has a fixed batch dimension is refused: its bodies were traced for that batch
      before the op was made and its input relaxed (a loop's accumulators hold
      elements of that shape).  (``_check_rows``)"""
    for tg in ir_graph.taskgraphs:
        for op in tg.ops:
            if not functions.is_call(op) or ir_graph.phase_of(op) != ir.FORWARD:
                continue
            inside = _body_strategies(op.graph, op, set())
            split = [(s, n) for s, n in inside.items()
                     if s.kind == "split" and s is not tg.strategy]
            if split:
                strategy, name = split[0]
                raise ValueError(
                    "EPL: %s runs %r of the %s scope inside its body, but the %s itself "
                    "was built in %s. A split layer computes on the rows of every replica "
                    "at once, which one replica's loop or condition cannot give it. Build "
                    "the whole %s inside the split scope (with %s: tf.while_loop(...)), or "
                    "the split layer outside it."
                    % (describe_call(op), name, strategy, _kind(op), tg.strategy,
                       _kind(op), strategy))
            _check_rows(ir_graph, tg, op)
            if tg.kind == "split" and not functions.runs_apart_from_captured_variables():
                shards = set(ir_graph.shard_of(t.op) for t in op.inputs
                             if ir.is_state_handle(t) and t.op.type in VARIABLE_OPS
                             and ir_graph.taskgraph_of(t.op) is tg)
                if len(shards) > 1:
                    raise NotImplementedError(
                        "EPL: %s of the %s scope reads variables of several shards inside "
                        "its body, but this TensorFlow runs a v2 %s on the device of "
                        "every variable it reads, and the shards live on %d devices. Build "
                        "the split layer outside the %s (call it on the %s's output), or "
                        "use TensorFlow 2.x." % (describe_call(op), tg.strategy, _kind(op),
                                                 len(shards), _kind(op), _kind(op)))


def _check_rows(ir_graph, tg, op):
    """A call op of a re-batching scope does not read a relaxed view of a fixed-batch
    tensor (its bodies were built for the fixed batch)."""
    if tg.kind != "split" and tg.device_count <= 1:     # (``epl.capture.rebatch.rebatches``)
        return
    for t in op.inputs:
        fixed = ir_graph.relaxed.get(t.op.name)
        if fixed is None:
            continue
        rows = fixed.shape.as_list()[0]
        raise ValueError(
            "EPL: %s of the %s scope reads %r, whose batch dimension is fixed (%d rows), "
            "but the scope runs on another number of rows (a split scope computes on every "
            "replica's rows, replicate(k > 1) on a k-th of them), and TensorFlow built the "
            "%s's bodies for %d rows. Give its input an unknown batch dimension inside the "
            "scope, before the %s (tf.compat.v1.placeholder_with_default(t, [None, ...])), "
            "or build the %s outside the scope."
            % (describe_call(op), tg.strategy, fixed.name, rows, _kind(op), rows, _kind(op),
               _kind(op)))


def _kind(op):
    return "loop" if functions.CALL_OPS[op.type] == "loop" else "condition"


def _stage_key(example):
    """Examples ordered by the stage scope they name (stage_0 before stage_1)."""
    return example.split(" in ", 1)[1] if " in " in example else example


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
    if isinstance(copy, control_flow_pb2.WhileContextDef):
        return control_flow_ops.WhileContext.from_proto(copy)
    return control_flow_ops.CondContext.from_proto(copy)


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
    if isinstance(proto, control_flow_pb2.WhileContextDef):
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


# -- v2 bodies per clone ---------------------------------------------------------------

class _Bodies(object):
    """What the rewrites of one graph did to v2 bodies."""

    def __init__(self):
        self.copies = {}      # (function, clone) -> its copy's name
        self.originals = {}   # copy's name -> function
        self.pending = []     # copies made, not yet in the library
        self.needs = {}       # (function, clone 0?) -> needs a copy (_needs_copy)
        self.calls = {}       # call op copied -> its signature then (note_calls)


def _record(graph):
    """The graph's ``_Bodies`` record."""
    rec = getattr(graph, "_epl_bodies", None)
    if rec is None:
        rec = _Bodies()
        setattr(graph, "_epl_bodies", rec)
    return rec


def _needs_copy(graph, name, clone0, memo):
    """Function ``name`` (or one it calls) needs a copy for a clone: devices set inside it
    (every clone, the user's ops too); colocation constraints, fixed random seeds or
    named shared resources (clones other than the user's)."""
    key = (name, clone0)
    if key in memo:
        return memo[key]
    memo[key] = False
    fdef = functions.function_def(graph, name)
    need = False
    for node in fdef.node_def if fdef is not None else ():
        if node.device:
            need = True
        elif not clone0 and ("_class" in node.attr or
                             ("seed2" in node.attr and node.attr["seed2"].i) or
                             ("shared_name" in node.attr and node.attr["shared_name"].s)):
            need = True
        elif any(_needs_copy(graph, n, clone0, memo) for n in functions.node_function_names(node)):
            need = True
        if need:
            break
    memo[key] = need
    return need


def needs_own_bodies(op, value, clone0=False):
    """The function-valued attribute ``value`` of the call op ``op`` names bodies that a
    clone (``clone0``: the user's own op) must have copies of."""
    graph = op.graph
    rec = _record(graph)
    originals, memo = rec.originals, rec.needs
    return any(_needs_copy(graph, originals.get(n, n), clone0, memo)
               for n in functions.attr_function_names(value))


def function_attr(state, c, value, seed_offset=0):
    """Clone c's value of a call op's function-valued attribute ``value``: the same
    functions, or the clone's copies of those that need one (``_needs_copy``), whose
    fixed random seeds (``seed2``) move by ``seed_offset`` (the cloner's seed step
    times c).  The copies are added to the library by ``add_pending_bodies``."""
    graph = state.graph
    originals = _record(graph).originals
    new = type(value)()
    new.CopyFrom(value)
    funcs = [new.func] if new.HasField("func") else list(new.list.func)
    for f in funcs:
        f.name = _copy_function(state, c, originals.get(f.name, f.name), seed_offset)
    return new


def _copy_function(state, c, name, seed_offset):
    graph = state.graph
    rec = _record(graph)
    copies, originals, pending, memo = rec.copies, rec.originals, rec.pending, rec.needs
    if not _needs_copy(graph, name, c == 0, memo):
        return name
    done = copies.get((name, c))
    if done is not None:
        return done
    fdef = functions.function_def(graph, name)
    new_name = "%s_EPL_CLONE_%d" % (name, c)
    k = 1
    while functions.has_function(graph, new_name) or new_name in originals:
        new_name = "%s_EPL_CLONE_%d_%d" % (name, c, k)
        k += 1
    copies[(name, c)] = new_name
    originals[new_name] = name
    copy = type(fdef)()
    copy.CopyFrom(fdef)
    copy.signature.name = new_name
    prefix = state.clone_name(c, "").encode()
    for node in copy.node_def:
        node.device = ""
        if c and "_class" in node.attr:
            groups = node.attr["_class"].list.s
            renamed = [b"loc:@" + prefix + g[len(b"loc:@"):] if g.startswith(b"loc:@") else g
                       for g in groups]
            del groups[:]
            groups.extend(renamed)
        if c and "seed2" in node.attr and node.attr["seed2"].i:
            # Stateful random ops with a fixed seed would repeat the user's stream.
            node.attr["seed2"].i += seed_offset
        if c and "shared_name" in node.attr and node.attr["shared_name"].s:
            # A named resource made inside a body (a table...) is the clone's own.
            node.attr["shared_name"].s = prefix + node.attr["shared_name"].s
        for value in node.attr.values():
            funcs = [value.func] if value.HasField("func") else (
                list(value.list.func) if value.HasField("list") else [])
            for f in funcs:
                f.name = _copy_function(state, c, f.name, seed_offset)
    pending.append(copy)
    return new_name


def add_pending_bodies(graph):
    """Add the body copies made since the last call to the graph's library (before the
    copies that call them are imported)."""
    pending = _record(graph).pending
    if pending:
        functions.add_function_defs(graph, pending)
        del pending[:]


def _signature(op):
    return (len(op.inputs), len(op.outputs),
            tuple(n for _, v in functions.function_attrs(op)
                  for n in functions.attr_function_names(v)))


def note_calls(state, ops):
    """Remember the v2 loops and conditions of ``ops`` as the clones copied them."""
    copied = _record(state.graph).calls
    for op in ops:
        if functions.is_call(op):
            copied[op] = _signature(op)


def check_calls_unchanged(state):
    """A v2 loop or condition copied by an earlier rewrite is as it was copied.  Its
    gradient changes it (TensorFlow gives the forward ``While`` / ``If`` the values the
    gradient needs as extra outputs, and new bodies): built after the first
    session.run, the clones' copies would lack them.  Refused with the op's name."""
    copied = _record(state.graph).calls
    for op, sig in copied.items():
        if _signature(op) != sig:
            raise RuntimeError(
                "EPL: %s changed after the graph was rewritten for %d clones (%r now has "
                "%d inputs and %d outputs, %d and %d when it was copied): its gradient was "
                "built after the first session.run, and TensorFlow extends the forward op "
                "to feed it. Build the gradients and the optimizer before the first "
                "session.run." % (describe_call(op), state.num_clones, op.name,
                                  len(op.inputs), len(op.outputs), sig[0], sig[1]))
