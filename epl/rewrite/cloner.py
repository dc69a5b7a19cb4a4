"""Copy ops inside their graph with new inputs and devices.

Two ways, one per need:

* ``clone_op``: one op, through ``Graph._create_op_internal`` (an input pull, a
  mirrored write): shapes are inferred as usual.
* ``CopyPlan``: the bulk of a replica, every clone at once, as one GraphDef
  imported through TensorFlow's C++ importer.  Building NodeDefs and importing
  them costs a fraction of creating the same ops one by one from Python, which
  matters at BERT scale (tens of thousands of ops per clone).  Ops inside TF1
  control flow keep their meaning: every clone's loops get their own frame
  names and control-flow contexts (``control_flow.py``).
"""
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.python import pywrap_tensorflow as c_api
from tensorflow.python.framework import c_api_util

from epl import tf_patches
from epl.rewrite import deferred

_SEED_ATTRS = ("seed2",)
SEED_STEP = 7919     # clone c's seed2 = seed2 + c * SEED_STEP


def clone_op(op, inputs, name, device, control_inputs=(), seed_offset=0, attr_overrides=None):
    """A copy of ``op`` named ``name`` on ``device`` reading ``inputs``."""
    from epl.rewrite.control_flow import context_of
    if context_of(op) is not None:
        raise NotImplementedError(
            "EPL cannot copy op %r (%s) on its own: it is inside a TF1 control-flow construct "
            "(tf.cond / tf.while_loop). Create it outside the loop or condition."
            % (op.name, op.type))
    g = op.graph
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    if seed_offset and any(k in attrs for k in _SEED_ATTRS) and attrs.get("seed2").i:
        # Stateful random ops with a fixed seed would repeat replica 0's stream.
        attrs["seed2"] = tf.compat.v1.AttrValue(i=attrs["seed2"].i + SEED_STEP * seed_offset)
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


class CopyPlan(object):
    """Nodes to add to ``graph`` in one import.  A node reads a node of the plan by
    its name, and an existing tensor or op through the key ``input_key`` /
    ``control_key`` gives it (the importer maps the keys)."""

    def __init__(self, graph):
        self.graph = graph
        self.versions = graph.graph_def_versions.SerializeToString()
        self.nodes = []          # serialized NodeDefs
        self.names = []          # node names in order
        self._inputs = {}        # existing tensor -> key name in the GraphDef
        self._controls = {}      # existing op -> key name

    def input_key(self, tensor):
        key = self._inputs.get(tensor)
        if key is None:
            key = "EPL_IMPORT_INPUT_%d" % len(self._inputs)
            self._inputs[tensor] = key
        return key

    def control_key(self, op):
        key = self._controls.get(op)
        if key is None:
            key = "EPL_IMPORT_CONTROL_%d" % len(self._controls)
            self._controls[op] = key
        return key

    @staticmethod
    def template(node_def, skip=()):
        """The serialized part of ``node_def`` every copy shares: its type and
        attributes (not ``_class`` colocation, nor the ``skip``ped ones each copy sets)."""
        base = node_def_pb2.NodeDef()
        base.op = node_def.op
        for k, v in node_def.attr.items():
            if k != "_class" and k not in skip:
                base.attr[k].CopyFrom(v)
        if node_def.HasField("experimental_debug_info"):
            base.experimental_debug_info.CopyFrom(node_def.experimental_debug_info)
        return base.SerializeToString()

    def add(self, template, name, device, inputs, controls, attrs=None):
        """A node of ``template`` (from ``template()``) named ``name`` on ``device``:
        ``inputs`` and ``controls`` are NodeDef input strings, ``attrs`` {name:
        AttrValue} the attributes it sets itself.  Serialized directly: building
        NodeDef messages field by field from Python costs more than the import."""
        parts = [_field(b"\x0a", name.encode()), template]
        parts.extend(_field(b"\x1a", i.encode()) for i in inputs)
        parts.extend(_field(b"\x1a", ("^" + c).encode()) for c in controls)
        parts.append(_field(b"\x22", device.encode()))
        for k, v in (attrs or {}).items():
            entry = _field(b"\x0a", k.encode()) + _field(b"\x12", v.SerializeToString())
            parts.append(_field(b"\x2a", entry))
        self.nodes.append(_field(b"\x0a", b"".join(parts)))
        self.names.append(name)

    def serialized(self):
        """The GraphDef (field 1: nodes, field 4: versions)."""
        return b"".join(self.nodes) + _field(b"\x22", self.versions)

    def run(self):
        """Import the nodes; returns {planned name: name} (the importer renames a node
        named like an existing name scope).  Their Python ops are made on first use
        (``deferred.py``)."""
        g = self.graph
        if not self.names:
            return {}
        scoped = c_api_util.ScopedTFImportGraphDefOptions()
        options = scoped.options
        c_api.TF_ImportGraphDefOptionsSetPrefix(options, "")
        # TensorFlow's importer refuses an op named like an existing name scope
        # ("opt" after "opt/learning_rate", which Python allows): such a copy gets a
        # suffix, as in Python.
        c_api.TF_ImportGraphDefOptionsSetUniquifyNames(options, True)
        c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
        for t, key in self._inputs.items():
            c_api.TF_ImportGraphDefOptionsAddInputMapping(options, key, 0, t._as_tf_output())  # pylint: disable=protected-access
        for op, key in self._controls.items():
            c_api.TF_ImportGraphDefOptionsRemapControlDependency(options, key, op._c_op)  # pylint: disable=protected-access
        for name in self.names:
            c_api.TF_ImportGraphDefOptionsAddReturnOperation(options, name)
        with g._mutation_lock():  # pylint: disable=protected-access
            with c_api_util.tf_buffer(self.serialized()) as serialized:
                try:
                    results = c_api.TF_GraphImportGraphDefWithResults(
                        g._c_graph, serialized, options)  # pylint: disable=protected-access
                except tf.errors.InvalidArgumentError as e:
                    raise ValueError("EPL could not copy the replica's ops: %s" % e.message)
                results = c_api_util.ScopedTFImportGraphDefResults(results)
            c_ops = c_api.TF_ImportGraphDefResultsReturnOperations(results.results)
            names = [c_api.TF_OperationName(c_op) for c_op in c_ops]
            deferred.register(g, names, c_ops)
        return dict(zip(self.names, names))


def _varint(n):
    out = bytearray()
    while n > 0x7f:
        out.append((n & 0x7f) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(128)]


def _field(tag, payload):
    """A length-delimited protobuf field: tag, length, bytes."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + payload


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
