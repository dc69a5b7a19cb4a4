"""ReplicaClonePass: one copy of the replica's ops per clone, on its device.

The replica's ops (in creation order, a topological order of the user's graph)
are cut into segments at the reduction sites (``updates.py``): just before the
first op that reads a site's gradients, those gradients are reduced across
clones (``gradients.py``), so every clone's update reads the reduced gradient.
Each segment is copied for every clone at once, as one GraphDef import
(``cloner.CopyPlan``); v1 loops get per-clone frame names (``loop_contexts.frame_attr``;
their contexts: the ``copy_loop_contexts`` pass); v2 loops and conditions are ops like
any other, whose copies call the same bodies or, where a clone needs its own, copies of
them (``function_bodies.function_attr``).
"""
import tensorflow as tf

from epl import ir
from epl.rewrite import function_bodies, loop_contexts
from epl.rewrite.cloner import (PREFIX, SEED_STEP, CopyPlan, Hole, attr_entry, has_fixed_seed,
                                import_copies, template)
from epl.rewrite.gradients import reduce_gradients
from epl.rewrite.selection import VARIABLE_OPS
from epl.tf_adapter import functions
from epl.tf_adapter import graph as tfg


def place_originals(state, sel, templates):
    """The user's replica ops go to clone 0's device (shared variables and the
    single update too, when a worker shares one copy of its variables).  A write to
    a variable runs where the variable lives.  ``templates`` (this pass's product): each
    op's NodeDef template, taken before the placement changes it, for ``clone_replicas``."""
    for op in originals(sel):
        # Our placement replaces TF's colocation hints: tf.gradients colocates a
        # gradient sum with its first input, which may live on another stage.
        templates[op] = base = template(op, _CLONE_ATTRS)     # (kept for the copies)
        if "_class" in base[1]:
            tfg.clear_colocation(op)
        tfg.set_device(op, _device_for(state, 0, op.inputs, op))
    # (devices set inside the bodies of its loops and conditions: the
    # ``place_original_bodies`` pass)


def originals(sel):
    """The user's ops ``place_originals`` places: the replica's and the shared ones, in
    creation order."""
    return sorted(list(sel.ops) + list(sel.shared), key=tfg.op_id)


def _device_for(state, c, inputs, op):
    """Clone c's device for the op's stage, unless the op takes a variable itself (a
    resource read, an update): TF keeps those on the variable's device (a shared
    variable is on clone 0's).  Not a v2 loop or condition that captured a variable
    where TensorFlow lets it run elsewhere (``_apart``).  With ``offload.level`` the variables live in host
    memory; their readers send each value to the device that uses it."""
    if op.type in VARIABLE_OPS and state.cluster.offload:
        return state.host_device(c)
    if op in state.zero_owners:
        return state.zero_owners[op]
    if not _apart(op):
        for t in inputs:
            if ir.is_state_handle(t) and t.op.type in VARIABLE_OPS and t.op.device:
                return t.op.device
    return state.device_for(c, op)


def _apart(op):
    """``op`` is a v2 loop or condition that may run apart from the variables it
    captured (TF 2.x: its bodies' reads go to the variable; on TF 1.15 it follows the
    variable, like any op that takes one)."""
    return functions.is_call(op) and functions.runs_apart_from_captured_variables()


def owned(state, op):
    """Ops a replica runs once for all its micro-batches: variables and updates."""
    return op.type in VARIABLE_OPS or op in state.selection.updates.run_once


def clone_replicas(state, sel, templates):
    """Copy ``sel``'s ops (the replica, or what was added to it) per clone.
    ``templates``: ``place_originals``'s NodeDef templates (taken as used).  (The copies'
    v1 contexts: the ``copy_loop_contexts`` pass; the v2 loops copied: ``note_copied_calls``.)"""
    # A site whose readers are not copied (shared variables) is reduced last.
    pending = sorted(((_first_id(sel, site), site) for site in sel.updates.sites),
                     key=lambda x: (x[0], x[1].index))
    segment = []
    for op in sel.ops:
        while pending and tfg.op_id(op) >= pending[0][0]:
            _copy_segment(state, segment, templates)
            segment = []
            reduce_gradients(state, pending.pop(0)[1])
        segment.append(op)
    _copy_segment(state, segment, templates)
    for _, rec in pending:
        reduce_gradients(state, rec)


def _copy_segment(state, ops, templates):
    """Every clone's copy of ``ops`` (made in one import).  Micro-batches of a
    replica share its variables and its one update (``owned``), and its constants
    (on their device already): their copies read the replica's copies of those, or
    the user's ops for replica 0."""
    n = state.num_clones
    if n == 1 or not ops:
        return
    own = set(op for op in ops if owned(state, op) or _constant(op))
    described = _describe(state, ops, templates)
    kinds = {}      # kind of clone -> its _Segment
    copies = []     # (clone, its segment, where its nodes start in the plan)
    for c in sorted(range(1, n), key=lambda c: not state.is_rep(c)):
        # A replica copies every op; a micro-batch reads the skipped ops of its
        # replica's copy (made in this import), or the user's ops for replica 0.
        kind = state.is_rep(c)
        if kind not in kinds:
            clones = [cc for cc in range(1, n) if state.is_rep(cc) == kind]
            kinds[kind] = _Segment(state, described, () if kind else own, clones)
        seg = kinds[kind]
        copies.append((c, seg, len(seg.plan.names)))
        seg.copy(c)
    segments = list(kinds.values())
    function_bodies.add_pending_bodies(state.graph)     # (the copies call them)
    made = dict(zip(segments, import_copies(state.graph, [seg.plan for seg in segments])))
    for c, seg, start in copies:
        seg.install(c, made[seg][start:start + len(seg.ops)])


def _describe(state, ops, templates):
    """What every copy of each op needs, found once: (op, NodeDef template, the
    attributes each clone sets itself, inputs, control inputs, device class)."""
    members = set(ops)
    out = []
    for op in ops:
        base, names = templates.pop(op, None) or template(op, _CLONE_ATTRS)
        own = _own_attrs(op, names)
        if len(own) < len(set(names) & set(_CLONE_ATTRS)):   # (an op without a fixed seed keeps seed2)
            base, _ = template(op, own)
        where = None    # the variable the op takes itself (a resource read, an update)
        inputs = list(op.inputs)
        # (a v2 loop or condition hands the variables it captured to its bodies: where
        # TensorFlow allows, it runs on its stage, like the rest of its clone)
        for t in () if _apart(op) else inputs:
            if ir.is_state_handle(t) and t.op.type in VARIABLE_OPS:
                where = ("variable", t.op, t.op in members, state.lane_of(op))
                break
        if op.type in VARIABLE_OPS and state.cluster.offload:
            where = ("host",)
        out.append((op, base, own, inputs, op.control_inputs,
                    where or ("stage", state.lane_of(op))))
    return members, out


def _constant(op):
    """A constant outside loops and conditions (those are tied to their frame by a
    control input)."""
    return (op.type == "Const" and not op.control_inputs
            and loop_contexts.context_of(op) is None)


class _Segment(object):
    """A segment's nodes as every clone of one kind copies them, with the holes each
    clone fills: its name prefix ``p``, the device of each class of ops ``d<k>``,
    its own attributes ``a<k>_<name>``.  The ``skipped`` ops are not copied: the
    copies read those of the replica whose name prefix fills the hole ``r`` (the
    user's ops for replica 0: their names are mapped to them)."""

    def __init__(self, state, described, skipped, clones):
        self.state = state
        self.plan = plan = CopyPlan()
        members, records = described
        self.skip = skip = set(skipped)
        self.skipped = [r[0] for r in records if r[0] in skip]
        self.ops = []
        self.own_attrs = []     # (op, {attribute: user's value}, holes): see _attrs
        self.classes = {}       # device class -> its hole
        self.inputs = {}        # key -> existing tensor (the clone's, see state.tensor)
        self.controls = {}      # key -> existing op (the clone's)
        # name a copy reads a skipped op by -> the user's tensor, and -> the user's op (a
        # name can be both: an op's output read by one copy, the op a control input of
        # another; the importer maps the two separately)
        self.user = ({}, {})
        self.shared = {}        # key every copy maps to the same existing tensor / op
        p = PREFIX
        refs = {}

        def ref(x, op, table):
            """How a copy names x (a tensor of ``op``, or ``op`` itself)."""
            r = refs.get(x)
            if r is None:
                if op not in members:
                    k = "EPL_IMPORT_%d" % len(refs)
                    if all((state.op(c, x) if x is op else state.tensor(c, x)) is x
                           for c in clones):
                        # The same existing tensor in every copy: one key for all.
                        self.shared["EPL_IMPORT_SHARED/" + k] = x
                        r = ("EPL_IMPORT_SHARED/" + k,)
                    else:
                        table[k] = x
                        r = (p, k)
                else:
                    name = x.name if x is op or x.value_index else op.name
                    if op in skip:
                        self.user[x is op][name] = x
                        r = (REPLICA, name)
                    else:
                        r = (p, name)
                refs[x] = r
            return r

        for op, base, own_attrs, inputs, controls, where in records:
            if op in skip:
                continue
            device = self.classes.get(where)
            if device is None:
                device = self.classes[where] = Hole("d%d" % len(self.classes))
            holes = [Hole("a%d_%s" % (len(self.own_attrs), k)) for k in own_attrs]
            if holes:
                self.own_attrs.append((op, own_attrs, holes))
            plan.node(op.name, base, [ref(t, t.op, self.inputs) for t in inputs],
                      [ref(ci, ci, self.controls) for ci in controls], (device,), holes)
            self.ops.append(op)

    def copy(self, c):
        """Add clone c's copy to the plan."""
        state = self.state
        pre = state.clone_name(c, "")
        values = {PREFIX: pre}
        if REPLICA in self.plan.holes:
            values[REPLICA] = state.clone_name(state.reps[c], "") if state.reps[c] else ""
        for where, hole in self.classes.items():
            values[hole] = self._device(c, where)
        for op, own, holes in self.own_attrs:
            attrs = _attrs(state, c, op, own)
            for hole, k in zip(holes, own):     # (one hole per attribute, in order)
                values[hole] = attr_entry(k, attrs[k])
        inputs = {pre + k: state.tensor(c, t) for k, t in self.inputs.items()}
        controls = {pre + k: state.op(c, x) for k, x in self.controls.items()}
        for k, x in self.shared.items():
            (inputs if isinstance(x, tf.Tensor) else controls)[k] = x
        if not state.reps[c]:
            # replica 0's micro-batches read the user's ops
            inputs.update(self.user[False])
            controls.update(self.user[True])
        self.plan.copy(values, inputs, controls)

    def install(self, c, names):
        """Clone c's copies are named ``names``."""
        state = self.state
        op_map = state.op_map[c]
        for op, name in zip(self.ops, names):
            op_map[op] = name
        rep = state.reps[c]
        for op in self.skipped:
            op_map[op] = state.op_map[rep][op] if rep else op

    def _device(self, c, where):
        """Clone c's device for one class of ops: its device of their stage, or the
        device of the variable they take (TF keeps those ops with their variable)."""
        state = self.state
        if where[0] == "stage":
            return state.stage_devices[c][where[1]]
        if where[0] == "host":
            return state.host_device(c)
        _, var, member, stage = where
        if member:
            # Copied in this segment: in clone c, or in its replica's copy
            # (micro-batches share the replica's variables); on its stage's device.
            cc = c if var not in self.skip else state.reps[c]
            dev = var.device if cc == 0 else _device_for(state, cc, (), var)
        else:
            dev = state.op(c, var).device
        return dev or state.stage_devices[c][stage]


# A v2 loop's / condition's functions (a call's ``f``): a clone may call copies.
_FUNCTION_ATTRS = ("cond", "body", "then_branch", "else_branch", "branches", "f")
_CLONE_ATTRS = ("seed2", "shared_name", "frame_name") + _FUNCTION_ATTRS
REPLICA = Hole("r")     # the name prefix of a micro-batch's replica


def _own_attrs(op, names):
    """{attribute: the user's value} of the attributes every clone sets itself (see
    ``_attrs``); ``names``: the op's attributes."""
    own = {}
    if "seed2" in names and has_fixed_seed(op.node_def.attr):
        own["seed2"] = op.get_attr("seed2")
    if "shared_name" in names and (op.type == "VarHandleOp" or op.get_attr("shared_name")):
        own["shared_name"] = op.get_attr("shared_name")
    if op.type in ("Enter", "RefEnter"):
        own["frame_name"] = op.get_attr("frame_name")
    if functions.is_call(op):
        for k, v in functions.function_attrs(op):
            if k in _FUNCTION_ATTRS and function_bodies.needs_own_bodies(op, v):
                own[k] = v
    return own


def _attrs(state, c, op, own):
    """Clone c's attribute changes: its own seed stream, variable names, loop frames and
    v2 bodies."""
    attrs = {}
    if "seed2" in own:
        # Stateful random ops with a fixed seed would repeat replica 0's stream.
        attrs["seed2"] = tf.compat.v1.AttrValue(i=own["seed2"] + SEED_STEP * c)
    if "shared_name" in own:
        name = op.name if op.type == "VarHandleOp" else own["shared_name"].decode()
        attrs["shared_name"] = tf.compat.v1.AttrValue(s=state.clone_name(c, name).encode())
    if "frame_name" in own:
        attrs["frame_name"] = loop_contexts.frame_attr(
            c, state, tf.compat.v1.AttrValue(s=own["frame_name"]))
    for k in _FUNCTION_ATTRS:
        if k in own:
            attrs[k] = function_bodies.function_attr(state, c, own[k], SEED_STEP * c)
    return attrs


def _first_id(sel, site):
    """Where to reduce ``site``: just before the first copied op that reads its
    gradients (not the gradient call's own ops), once all of them exist."""
    wanted = set(site.tensors())
    made = [tfg.op_id(t.op) for t in wanted]
    ids = [tfg.op_id(op) for op in sel.ops
           if tfg.op_id(op) not in site.origin_ids and any(t in wanted for t in op.inputs)]
    if not ids:
        return float("inf")
    return max(min(ids), max(made) + 1)


def _is_update(state, op):
    plan = state.selection.updates
    return (op.type not in VARIABLE_OPS and op.type != "Const"
            and (op in plan.target or state.ir_graph.phase_of(op) == ir.APPLY))


def join_clones(state, sel, since=-1):
    """Running the user's train op must run every clone's update.

    * Every update a replica runs once waits for its copies: whichever of them the
      user fetches (``minimize``'s result, a keras optimizer's counter increment, a
      hand-written ``assign_sub``, ...) runs every replica's update.
    * An update a replica runs once for all its micro-batches also runs the
      micro-batches' copies of what it waits for (their batch-norm updates...).
    * An op outside the replica (a shared update, the ``global_step`` increment)
      that waits for a replica op, or reads a replica's update, waits for all copies.

    ``sel``: the replica ops to join (of this rewrite), ``since``: the last op id an
    earlier rewrite saw.
    """
    whole = state.selection
    n = state.num_clones
    owners = [c for c in range(1, n) if state.is_rep(c)]  # hold an update
    for op in sel.ops:
        if owners and owned(state, op) and _is_update(state, op):
            tfg.add_control_inputs(op, [state.op(c, op) for c in owners])
    for op in sel.ops:
        if not owned(state, op):
            continue
        for ci in op.control_inputs:
            if ci in whole and not owned(state, ci):
                for c in range(1, n):
                    if not state.is_rep(c):
                        tfg.add_control_inputs(state.op(state.reps[c], op), [state.op(c, ci)])
    for op in tfg.ops_between(state.graph, since + 1):
        if op in whole or state.ir_graph.phase_of(op) == ir.REWRITE:
            continue
        extra = [state.op(c, ci) for ci in op.control_inputs if ci in whole
                 for c in range(1, n)]
        extra += [state.op(c, t.op) for t in op.inputs
                  if t.op in whole and _is_update(state, t.op) for c in owners]
        extra = [e for e in extra if e not in op.control_inputs]
        if extra:
            tfg.add_control_inputs(op, extra)

