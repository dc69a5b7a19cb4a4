"""An optimizer's update of a variable, timed like the step's other kernels
(``product_timing``): its key (``signature``) and a chain of copies of it on variables
taken in turn from enough sets to be out of the caches (``chain``).  A replayed step
adds its updates' times after it (``local_step.update_seconds``) instead of pricing the
optimizer's state at a memory bandwidth calibrated per model (measured 18-54 GB/s for
two models of one run)."""
import base64
import json

import numpy as np
import tensorflow as tf

from epl import ir

v1 = tf.compat.v1

# an optimizer's update of a variable: the fused kernels (Adam, momentum, ...), and the
# assignments a hand-written optimizer makes
_ASSIGNS = ("Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
            "AssignSubVariableOp")


def signature(op):
    """A JSON-able key of an optimizer's update of a float variable (an ``Apply*`` or
    ``ResourceApply*`` kernel, an assignment), or None: its NodeDef and each input as
    ["ref" | "resource" | "value", dtype, shape].  Sparse updates (indices) are left
    out."""
    if not (op.type.startswith("Apply") or op.type.startswith("ResourceApply")
            or op.type in _ASSIGNS) or "Sparse" in op.type:
        return None
    inputs = []
    for t in op.inputs:
        kind, dtype, shape = "value", t.dtype, t.shape
        if t.dtype.base_dtype.name == "resource":
            handle = t.op
            while handle.type == "Identity" and handle.inputs:
                handle = handle.inputs[0].op
            if handle.type != "VarHandleOp":
                return None
            kind, dtype = "resource", handle.get_attr("dtype")
            shape = tf.TensorShape(handle.get_attr("shape"))
        elif ir.is_state_handle(t):
            kind, dtype = "ref", t.dtype.base_dtype
        if not dtype.is_floating or not shape.is_fully_defined():
            return None
        inputs.append([kind, dtype.name, shape.as_list()])
    if not any(kind != "value" for kind, _, _ in inputs):
        return None
    return json.dumps(["update", op.type, node_blob(op), inputs])


def node_blob(op):
    """The op's NodeDef without its name, inputs, device and private attributes."""
    node = v1.NodeDef()
    node.op = op.type
    for name, value in op.node_def.attr.items():
        if not name.startswith("_"):
            node.attr[name].CopyFrom(value)
    return base64.b64encode(node.SerializeToString(deterministic=True)).decode()


INITS = "epl_auto_update_inits"     # the timed updates' variables' initializers
# A step updates each variable once, its state (the weights, Adam's slots) last touched
# a step before, out of the caches, while a chain updating one set of variables again
# and again keeps it in them (measured: the wide head's 512 x 8192 Adam update took
# 2.2 ms in such a chain, and added 4-5 ms to its step).  So a chain's copies take
# their variables in turn from enough sets that they are cold: COLD_BYTES at least.
COLD_BYTES = 1 << 30
_variables_made = [0]


def sets_for(sig, length, cold_bytes=COLD_BYTES):
    """How many sets of variables a chain of ``length`` copies of ``sig`` rotates over:
    enough for ``cold_bytes`` of state (each variable at its dtype's width), at most
    one per copy."""
    state = sum(tf.as_dtype(dtype).size * max(1, int(np.prod(dims)))
                for how, dtype, dims in json.loads(sig)[3] if how != "value")
    return int(min(length, max(1, -(-cold_bytes // max(state, 1)))))


def chain(sig, rng, device, length, sets=None):
    """``length`` copies of the update of ``signature`` ``sig`` on ``device``, each
    after the one before, their variables taken in turn from ``sets`` sets (default
    ``sets_for``; their initializers are added to the graph's ``INITS`` collection):
    the ops, in order.  Its scalars (a learning rate, Adam's betas and their powers) are
    0.5, its other values random (made in the graph: no large constants)."""
    _, _, blob, inputs = json.loads(sig)
    sets = sets or sets_for(sig, length)
    seed = int(rng.randint(1 << 30))
    graph_def, feeds, inits = v1.GraphDef(), {}, []

    def holder(name, dtype):
        node = graph_def.node.add()
        node.name, node.op = name, "Placeholder"
        node.attr["dtype"].type = dtype.as_datatype_enum

    for i, (how, dtype, dims) in enumerate(inputs):
        dtype = tf.as_dtype(dtype)
        made = v1.Variable(v1.random_uniform(dims, 0.5, 1.5, seed=seed + i) if dims
                           else 0.5, trainable=False)
        feeds["value_%d:0" % i] = tf.identity(tf.cast(made, dtype))   # (read once)
        holder("value_%d" % i, dtype)
        if how == "value":
            continue
        for k in range(sets):
            held, init = graph_def.node.add(), graph_def.node.add()
            held.name, held.device = "in_%d_%d" % (i, k), device
            held.attr["dtype"].type = dtype.as_datatype_enum
            held.attr["shape"].shape.CopyFrom(tf.TensorShape(dims).as_proto())
            init.name, init.device = "init_%d_%d" % (i, k), device
            init.input[:] = [held.name, "value_%d" % i]
            inits.append(init.name)
            if how == "ref":
                held.op, init.op = "VariableV2", "Assign"
                init.attr["T"].type = dtype.as_datatype_enum
            else:
                _variables_made[0] += 1
                held.op, init.op = "VarHandleOp", "AssignVariableOp"
                held.attr["shared_name"].s = b"epl_auto_update_%d" % _variables_made[0]
                init.attr["dtype"].type = dtype.as_datatype_enum
    names = []
    for k in range(length):
        node = v1.NodeDef.FromString(base64.b64decode(blob))
        node.name, node.device = "kernel_%d" % k, device
        node.input.extend(("in_%d_%d" % (i, k % sets) if how != "value" else "value_%d" % i)
                          for i, (how, _, _) in enumerate(inputs))
        if k:
            node.input.append("^kernel_%d" % (k - 1))
        graph_def.node.extend([node])
        names.append(node.name)
    ops = v1.import_graph_def(graph_def, input_map=feeds, return_elements=names + inits,
                              name="u")
    for op in ops[length:]:
        v1.add_to_collection(INITS, op)
    return ops[:length]
