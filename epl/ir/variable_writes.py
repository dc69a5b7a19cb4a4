"""Which variable an op writes or reads, and which writes are updates by hand.

Questions about state that capture-time features (AMP's overflow skip, accumulation
across runs, the apply gate) and the rewrite passes both ask, answered from the graph's
structure (op types and the edges to a variable), not from names.
"""
from epl import ir
from epl.tf_adapter import functions
from epl.tf_adapter import graph as tfg

VARIABLE_OPS = frozenset(["VariableV2", "Variable", "VarHandleOp"])
# Ops that set a variable's whole value or add to it.
ASSIGN_OPS = frozenset(["Assign", "AssignAdd", "AssignSub", "AssignVariableOp",
                        "AssignAddVariableOp", "AssignSubVariableOp"])
# Ops that take a variable (ref or resource) without changing it.
READ_OPS = frozenset(["IsVariableInitialized", "VarIsInitializedOp", "ReadVariableOp",
                      "ResourceGather", "ResourceGatherNd", "VariableShape", "RefIdentity",
                      "RefSwitch", "RefEnter", "RefMerge", "RefExit", "RefNextIteration",
                      "RefSelect", "Identity", "Switch", "Enter", "Exit", "Merge",
                      "NextIteration", "DestroyResourceOp", "_Retval", "Placeholder"])


def written_variable(op):
    """The variable op ``op`` writes, or None (reads and passthroughs are not writes).
    A v2 loop or condition writes a variable it captured only if one of its bodies
    does (``functions.written_inputs``): most only read theirs."""
    if op.type in READ_OPS:
        return None
    written = functions.written_inputs(op) if functions.is_call(op) else None
    for i, t in enumerate(op.inputs):
        if not ir.is_state_handle(t) or (written is not None and i not in written):
            continue
        if tfg.is_ref_dtype(t.dtype) and not tfg.input_wants_ref(op, i):
            continue  # a ref read as a value
        var = variable_of(t)
        if var is not None and (tfg.is_ref_dtype(t.dtype) or op.op_def.is_stateful):
            return var
    return None


def variable_behind(x):
    """The variable op of a tf.Variable, or of a tensor that reads one, or None."""
    op = getattr(x, "op", None)
    if op is None or op.type in VARIABLE_OPS:
        return op
    if op.type == "ReadVariableOp":
        return variable_of(op.inputs[0])
    return variable_of(x)


# Ops that hand their first input's variable on unchanged: identities, and a v1 loop's /
# condition's entry into its body (a write inside a tf.while_loop or tf.cond body takes
# the variable through them).
_PASSTHROUGH = frozenset(["Identity", "RefIdentity", "Enter", "RefEnter", "Switch",
                          "RefSwitch"])


def variable_of(t):
    """The variable op behind a ref/resource tensor (through identity-like ops)."""
    seen = 0
    while t.op.type not in VARIABLE_OPS and seen < 16:
        if t.op.type in _PASSTHROUGH and t.op.inputs:
            t = t.op.inputs[0]
            seen += 1
        else:
            return None
    return t.op if t.op.type in VARIABLE_OPS else None


def advances(op, var):
    """``op``, a write of the step variable op ``var``, computes the new value from the
    step's current one (an increment), rather than setting it (an initializer, a
    restore: they cannot read the variable they initialize)."""
    if op.type.startswith(("AssignAdd", "AssignSub")):
        return True
    return len(op.inputs) > 1 and var in ir.upstream([op.inputs[1].op], control=False)


def hand_written_update(epl_graph, handled_ids, since=-1):
    """The first op (made after id ``since``) outside ``handled_ids`` that writes a
    trainable variable from gradients (an update written by hand), or None."""
    graph = epl_graph.tf_graph
    trainable = set(v.op for v in graph.get_collection("trainable_variables"))
    for op in graph.get_operations():
        if tfg.op_id(op) <= since or tfg.op_id(op) in handled_ids:
            continue
        if written_variable(op) in trainable and reads_gradients(epl_graph, op):
            return op
    return None


def reads_gradients(epl_graph, op):
    """``op`` computes from a tf.gradients result (not an initializer, a restore, a
    hand-written assign of a constant)."""
    return any(epl_graph.phase_of(up) == ir.BACKWARD
               for up in ir.upstream([op], control=False))
