"""Loops and conditions EPL cannot rewrite, refused by name before the selection.

Why a module: a loop or condition (v1 contexts, or a v2 ``While`` / ``If`` op with its
bodies) is copied per clone whole; a few ways of building one around EPL's scopes would
give copies that silently compute something else.  These checks read the IR and the
graph, edit neither, and run from ``rewrite.prepare_state`` for every layout
(``check_stages``), before the analyses that would trust the IR:

* a loop or condition runs on one pipeline stage: one that spans two (v1: its context
  holds forward ops of two stages' scopes; v2: ops built inside its body under another
  stage's scope) is refused;
* an ``epl.split`` scope and the v2 loops and conditions it meets
  (``check_split_scopes``): a split layer inside the body of a loop built outside the
  split scope (a split layer computes on every replica's rows at once); on TF 1.15 a
  split scope's loop whose body reads shards on several devices; a call op of a
  re-batching scope whose input has a fixed batch (its bodies were traced for it).

What capture records of v2 control flow is corrected where it is recorded, not here: ops
of v2 bodies never join the graph's TaskGraphs (``ir.Graph.record``), and the
accumulators a loop's gradient adds to the forward loop join the loop's TaskGraph at the
end of the gradient call that made them (``ir.Graph.adopt_loop_inputs``).  A loop the
clones copied that changed afterwards is refused by a later rewrite
(``function_bodies.check_calls_unchanged``).
"""
from epl import ir
from epl.ir.variable_writes import VARIABLE_OPS
from epl.rewrite.function_bodies import describe_call
from epl.rewrite.loop_contexts import context_of, describe, root_of
from epl.tf_adapter import contexts
from epl.tf_adapter import functions


def check_stages(ir_graph, taskgraphs, num_stages):
    """Every loop and condition of a pipeline's forward ops is built in one stage's
    scope.  (Their gradients follow: ops that tf.gradients adds to a forward loop, like
    its iteration counter, may be attributed to the stage whose gradient was being
    built.)  Checked before the stages are ordered: a loop across stages reads in
    both directions.  Runs before the selection, for every layout, with the checks of
    split scopes around v2 loops (``check_split_scopes``)."""
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
            what = "loop" if contexts.is_loop(root) else "condition"
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
            raise ValueError(
                "EPL: %s spans pipeline stages (%s). A loop or condition, with its body, "
                "must run on one stage: build the whole %s inside one stage's scope "
                "(epl.replicate), not a stage boundary inside its body."
                % (describe_call(op), ", ".join(sorted(examples, key=_stage_key)),
                   _kind(op)))


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
