"""Reads before updates: the check that a step's updates of a variable come after the
step's reads of it.

A training step reads each weight several times: the forward ops of every micro-batch
and replica, and the backward ops that propagate the gradient to the layer below
(``dX = dY . W^T``).  The update of ``W`` depends on ``dW``, not on ``dX``.  With ref
variables (TF1's default) a read aliases the variable's buffer until its consumers have
run, so an update that overtakes such a read hands the layer below a gradient computed
with the *updated* weight; on one device TensorFlow's executor usually runs them in the
right order, across a pipeline's devices and micro-batches, and under load, nothing
would.  GPipe and 1F1B put the update after the pipeline's flush: every read of the
step's weights first.

The rewrite keeps that order: every clone's updates wait for all of its reduced
gradients (``gradients.py``), and each gradient waits for the reads that compute it, so
the last read of a weight (a ``dX`` that feeds the layer below's ``dW``) comes before any
update.  The user's own graph need not have it (``tf.gradients`` then
``apply_gradients`` leaves a layer's ``dX`` unordered with its update; ``minimize``'s
per-op gate orders them).

``unordered_reads`` is the check behind it: over a rewritten graph and the ops a step
fetches, every (update, read) pair of one variable that nothing orders.
"""
from epl import ir
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import VARIABLE_OPS, written_variable

# Ops that hand a variable's ref or handle on (reading through them reads the variable).
_FORWARD_REF = frozenset(["Identity", "RefIdentity", "Enter", "RefEnter", "Switch",
                          "RefSwitch", "Merge", "RefMerge", "Exit", "RefExit"])
# Ops that touch a variable without reading its value for the step.
_NOT_A_READ = frozenset(["IsVariableInitialized", "VarIsInitializedOp", "VariableShape",
                         "DestroyResourceOp", "SaveV2", "Save", "SaveSlices"])


def variable_readers(var):
    """The ops that read variable op ``var``'s value, not counting its writes: the
    consumers of its ref (through identities and loop entries: a ref read aliases the
    buffer until its consumers have run) or a resource variable's ``ReadVariableOp``\\ s
    and gathers."""
    readers, seen = set(), set()
    stack = list(var.outputs)
    while stack:
        t = stack.pop()
        for c in t.consumers():
            if c in seen or c.type in _NOT_A_READ or c.type in VARIABLE_OPS:
                continue
            seen.add(c)
            if written_variable(c) is var:
                continue      # a write (its outputs are read after it)
            readers.add(c)
            if c.type in _FORWARD_REF:
                stack.extend(c.outputs)
    return readers


def unordered_reads(graph, fetches):
    """[(update, read)]: in the step that runs ``fetches`` (ops or tensors), pairs of a
    variable's write and a read of the same variable with no path between them, so
    TensorFlow may run them in either order.  For tests and debugging: it walks the
    whole step once per write."""
    ops = [getattr(f, "op", f) for f in fetches]
    step = ir.upstream(ops)
    out = []
    for w in sorted(step, key=tfg.op_id):
        if w.type in VARIABLE_OPS:
            continue
        var = written_variable(w)
        if var is None:
            continue
        readers = variable_readers(var) & step
        readers.discard(w)
        if not readers:
            continue
        before, after = ir.upstream([w]), ir.downstream([w])
        out.extend((w, r) for r in sorted(readers, key=tfg.op_id)
                   if r not in before and r not in after)
    return out
