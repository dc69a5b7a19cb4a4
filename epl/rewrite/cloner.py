"""Copy ops inside their graph with new inputs and devices.

Two ways, one per need:

* ``clone_op``: one op, through the graph's internal op constructor (an input pull, a
  mirrored write): shapes are inferred as usual.
* ``CopyPlan``: the bulk of a replica, every clone at once, as one GraphDef
  imported through TensorFlow's C++ importer (``import_copies``).  The nodes
  are serialized once, as a pattern each clone fills; importing them costs a
  fraction of creating the same ops one by one from Python, which matters at
  BERT scale (tens of thousands of ops per clone).  Ops inside TF1
  control flow keep their meaning: every clone's loops get their own frame
  names and control-flow contexts (``loop_contexts.py``); a control-flow-v2 loop or
  condition is one op whose copies call the same bodies, or copies of them where a
  clone needs its own (colocation, seeds, devices inside the bodies:
  ``function_bodies.py``).
"""
import tensorflow as tf

from epl.ir import capture_context
from epl.rewrite.loop_contexts import context_of
from epl.tf_adapter import c_graph, deferred
from epl.tf_adapter import graph as tfg

SEED_STEP = 7919     # clone c's seed2 = seed2 + c * SEED_STEP


def has_fixed_seed(attrs):
    """A random op's (``seed``, ``seed2``) attributes (a NodeDef's attr map) fix its stream:
    either is non-zero.  ``tf.nn.dropout(x, seed=0)`` without a graph seed gives
    (87654321, 0): a fixed stream with seed2 == 0, which every clone would repeat unless
    its seed2 is shifted too.  Only (0, 0) draws a new stream per kernel."""
    return "seed2" in attrs and (attrs["seed2"].i != 0
                                 or ("seed" in attrs and attrs["seed"].i != 0))


def clone_op(op, inputs, name, device, control_inputs=(), seed_offset=0, attr_overrides=None):
    """A copy of ``op`` named ``name`` on ``device`` reading ``inputs``."""
    if context_of(op) is not None:
        raise NotImplementedError(
            "EPL cannot copy op %r (%s) on its own: it is inside a TF1 control-flow construct "
            "(tf.cond / tf.while_loop). Create it outside the loop or condition."
            % (op.name, op.type))
    g = op.graph
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    if seed_offset and has_fixed_seed(attrs):
        # Stateful random ops with a fixed seed would repeat replica 0's stream.
        attrs["seed2"] = tf.compat.v1.AttrValue(i=attrs["seed2"].i + SEED_STEP * seed_offset)
    for k, v in (attr_overrides or {}).items():
        attrs[k] = v
    with g.name_scope(None), g.control_dependencies(None), \
            g.colocate_with(None, ignore_existing=True), capture_context.rewriting():
        new = tfg.create_op(g, op.type, inputs, [o.dtype for o in op.outputs],
                            input_types=[t.dtype for t in op.inputs], name=name,
                            attrs=attrs, op_def=op.op_def)
    tfg.set_device(new, device)
    if control_inputs:
        tfg.add_control_inputs(new, control_inputs)
    return new


class Hole(str):
    """A named gap in a ``CopyPlan`` node (the clone's name prefix, a device...) that
    every copy fills with its own value."""


PREFIX = Hole("p")
_JUST_PREFIX = (PREFIX,)


class CopyPlan(object):
    """Every clone's copy of the same nodes, added to ``graph`` in one import.

    A node is described once, as pieces: literal text and ``Hole``s.  A copy fills
    the holes (``copy``): the nodes' serialized bytes become a pattern per set of
    hole lengths (protobuf fields carry their lengths), and a copy is one C-level
    ``bytes %`` formatting of it, not a NodeDef per op per clone built in Python.
    References to existing tensors and ops go through keys each copy maps;
    ``import_copies`` adds the copies of several plans to the graph."""

    def __init__(self):
        self.nodes = []          # per node: its fields, see ``node``
        self.holes = set([PREFIX])
        self._fields = {}        # (tag, input pieces) -> field (inputs repeat)
        self._patterns = {}      # hole lengths -> pattern
        self.chunks = []         # every copy's serialized nodes
        self.names = []          # every copy's node names, in order
        self.inputs = {}         # key -> existing tensor
        self.controls = {}       # key -> existing op (or C node)

    def node(self, name, template, inputs, controls, device, attrs=()):
        """A node of ``template`` (from ``template()``) named ``name`` after the
        copy's prefix (the hole ``PREFIX``); every one of ``inputs`` / ``controls``
        (NodeDef input strings, without the ``^``) and ``device`` is a sequence of
        pieces: ``str`` literals and ``Hole``s.  ``attrs``: holes each copy fills
        with one attribute of its own (``attr_entry``)."""
        encoded = name.encode()
        fields = [(b"\x0a", len(encoded), _JUST_PREFIX, b"%(p)b" + encoded.replace(b"%", b"%%"))]
        known = self._fields
        for tag, items in ((b"\x1a", inputs), (b"\x1a^", controls)):
            for i in items:
                f = known.get((tag, i))
                if f is None:
                    f = known[(tag, i)] = _pieces(tag[:1], (tag[1:].decode(),) + tuple(i))
                    self.holes.update(f[2])
                fields.append(f)
        f = known.get(device)
        if f is None:
            f = known[device] = _pieces(b"\x22", device)
            self.holes.update(f[2])
        fields.append(f)
        if attrs:
            fields += [_pieces(b"\x2a", (h,)) for h in attrs]
            self.holes.update(attrs)
        self.nodes.append((name, fields, template.replace(b"%", b"%%"), len(template)))

    def copy(self, values, inputs=None, controls=None):
        """Add one copy: ``values`` {hole: str or bytes} fills the holes, ``inputs`` {key:
        tf.Tensor} and ``controls`` {key: tf.Operation or C node} map the keys its
        nodes read (an input key names an output: ``name`` or ``name:index``).
        The copy's node names (as planned) follow the plan's earlier ones in
        ``names``."""
        raw = {h: values[h] if isinstance(values[h], bytes) else values[h].encode()
               for h in self.holes}
        lengths = tuple(sorted((h, len(v)) for h, v in raw.items()))
        pattern = self._patterns.get(lengths)
        if pattern is None:
            pattern = self._patterns[lengths] = self._pattern(dict(lengths))
        self.chunks.append(pattern % {h.encode(): v for h, v in raw.items()})
        prefix = values[PREFIX]
        self.names.extend(prefix + node[0] for node in self.nodes)
        self.inputs.update(inputs or {})
        self.controls.update(controls or {})

    def _pattern(self, lengths):
        """The serialized nodes with holes of ``lengths`` {hole: length}, as a
        ``bytes %`` pattern (a literal ``%``, even in a length, is doubled)."""
        out = []
        sizes = {}      # holes -> their total length
        heads = {}      # (tag, length) -> (escaped field head, the field's size)
        for _, fields, template, template_len in self.nodes:
            body = []
            size = template_len
            for tag, fixed, holes, text in fields:
                n = sizes.get(holes)
                if n is None:
                    n = sizes[holes] = sum(lengths[h] for h in holes)
                n += fixed
                head = heads.get((tag, n))
                if head is None:
                    head = heads[(tag, n)] = (_head(tag, n), len(tag) + len(_varint(n)) + n)
                body.append(head[0])
                body.append(text)
                size += head[1]
            out.append(_head(b"\x0a", size))
            out.append(body[0])
            out.append(body[1])
            out.append(template)
            out.extend(body[2:])
        return b"".join(out)


def _head(tag, n):
    """A field's tag and length, escaped for a ``bytes %`` pattern."""
    return (tag + _varint(n)).replace(b"%", b"%%")


def import_copies(graph, plans):
    """Import every copy of every plan in ``plans`` at once (one import: each one
    walks the whole graph first); returns each plan's node names in the order of
    its ``names``.  Their Python ops are made on first use (``deferred.py``).

    The planned names are kept when none is taken.  TensorFlow's importer refuses
    a node named like an existing node (an input pull of the same name) or name
    scope ("opt" after an earlier import's "opt/learning_rate", which Python
    allows); the import is then made again (an import that fails changes nothing)
    with such copies renamed, as in Python, and their names read back."""
    planned = [name for p in plans for name in p.names]
    if not planned:
        return [[] for _ in plans]
    in_use = tfg.names_in_use(graph)
    names = None
    if not any(name.lower() in in_use for name in planned):
        try:
            _import(graph, plans, rename=False)
            names = planned
        except ValueError:
            pass
    if names is None:
        names = _import(graph, plans, rename=True)
    out = []
    start = 0
    for plan in plans:
        end = start + len(plan.names)
        out.append(names[start:end])
        start = end
    return out


def _import(graph, plans, rename):
    """The import of ``import_copies``; returns the copies' names."""
    inputs = [item for plan in plans for item in plan.inputs.items()]
    controls = [item for plan in plans for item in plan.controls.items()]
    serialized = b"".join(b"".join(p.chunks) for p in plans)
    serialized += _field(b"\x22", graph.graph_def_versions.SerializeToString())
    planned = [name for p in plans for name in p.names]
    return deferred.import_nodes(graph, serialized, inputs, controls, planned, rename)


def _pieces(tag, pieces):
    """(tag, length of the literal text, holes, pattern text) of one field."""
    fixed = 0
    holes = []
    text = []
    for x in pieces:
        if isinstance(x, Hole):
            holes.append(x)
            text.append(b"%%(%s)b" % x.encode())
        else:
            b = x.encode()
            fixed += len(b)
            text.append(b.replace(b"%", b"%%"))
    return tag, fixed, tuple(holes), b"".join(text)


def template(op, skip=()):
    """(the serialized part of ``op``'s NodeDef every copy shares, the names of its
    attributes).  The shared part is its type and attributes, less ``_class``
    colocation and the ``skip``ped ones each copy sets.  Cut from the serialized
    NodeDef without parsing it: a parsed NodeDef costs several times more."""
    data = c_graph.node_def_bytes(op)
    keep = []
    names = []
    i, end = 0, len(data)
    while i < end:
        tag = data[i]
        n, j = _read_varint(data, i + 1)
        if tag == 0x2a:       # attr: map entry, its key first (field 1)
            k, m = _read_varint(data, j + 1)
            name = data[m:m + k].decode()
            names.append(name)
            if name != "_class" and name not in skip:
                keep.append(data[i:j + n])
        elif tag in (0x12, 0x32):     # op type, debug info
            keep.append(data[i:j + n])
        i = j + n
    return b"".join(keep), names


def _read_varint(data, i):
    """(value, index after it) of the varint at ``data[i]``."""
    n = shift = 0
    while True:
        b = data[i]
        n |= (b & 0x7f) << shift
        i += 1
        if b < 0x80:
            return n, i
        shift += 7


def attr_entry(name, value):
    """A NodeDef attribute (map entry: key, ``AttrValue``) serialized, to fill a hole."""
    return _field(b"\x0a", name.encode()) + _field(b"\x12", value.SerializeToString())


def _varint(n):
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7f:
        out.append((n & 0x7f) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(128)]


def _field(tag, payload):
    """A length-delimited protobuf field: tag, length, bytes."""
    return tag + _varint(len(payload)) + payload


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
                     g.colocate_with(None, ignore_existing=True), capture_context.rewriting()]
        for cm in self._cms:
            cm.__enter__()
        return self

    def __exit__(self, *exc):
        for cm in reversed(self._cms):
            cm.__exit__(*exc)
        return False
