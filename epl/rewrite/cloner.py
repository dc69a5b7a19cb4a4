"""Copy one op inside its graph with new inputs and a device.

We copy NodeDefs through ``Graph._create_op_internal`` rather than import a
GraphDef: shapes are inferred as usual and the copy is an ordinary op the
later passes can edit.  Ops inside TF1 control flow (tf.cond, tf.while_loop)
carry a control-flow context that a plain copy would lose, so they are refused.
"""
import tensorflow as tf

from epl import tf_patches

_SEED_ATTRS = ("seed2",)


def check_clonable(op):
    if getattr(op, "_control_flow_context", None) is not None:
        raise NotImplementedError(
            "EPL cannot replicate op %r (%s): it is inside a TF1 control-flow construct "
            "(tf.cond / tf.while_loop / dynamic_rnn), which the replica cloner does not "
            "support yet. Build that part with static ops (e.g. tf.nn.static_rnn) or keep it "
            "outside the epl.replicate scope." % (op.name, op.type))


def clone_op(op, inputs, name, device, control_inputs=(), seed_offset=0, attr_overrides=None):
    """A copy of ``op`` named ``name`` on ``device`` reading ``inputs``."""
    check_clonable(op)
    g = op.graph
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    if seed_offset and any(k in attrs for k in _SEED_ATTRS) and attrs.get("seed2").i:
        # Stateful random ops with a fixed seed would repeat replica 0's stream.
        attrs["seed2"] = tf.compat.v1.AttrValue(i=attrs["seed2"].i + 7919 * seed_offset)
    for k, v in (attr_overrides or {}).items():
        attrs[k] = v
    with g.name_scope(None), g.control_dependencies(None), \
            g.colocate_with(None, ignore_existing=True), tf_patches.rewriting():
        new = g._create_op_internal(  # pylint: disable=protected-access
            op.type, list(inputs), [o.dtype for o in op.outputs],
            input_types=[t.dtype for t in op.inputs], name=name, attrs=attrs,
            op_def=op.op_def, compute_device=False)
    new._set_device(device)  # pylint: disable=protected-access
    if control_inputs:
        new._add_control_inputs(list(control_inputs))  # pylint: disable=protected-access
    return new


def new_ops(graph):
    """Context for EPL-made helper ops (no user scope, control deps or colocation)."""
    return _NewOps(graph)


class _NewOps(object):
    def __init__(self, graph):
        self.graph = graph
        self._cms = []

    def __enter__(self):
        g = self.graph
        self._cms = [g.as_default(), g.name_scope(None), g.control_dependencies(None),
                     g.colocate_with(None, ignore_existing=True), tf_patches.rewriting()]
        for cm in self._cms:
            cm.__enter__()
        return self

    def __exit__(self, *exc):
        for cm in reversed(self._cms):
            cm.__exit__(*exc)
        return False
