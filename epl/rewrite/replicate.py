"""ReplicaClonePass: one copy of the replica's ops per clone, on its device.

The replica's ops (in creation order, a topological order of the user's graph)
are cut into segments at the reduction sites (``updates.py``): just before the
first op that reads a site's gradients, those gradients are reduced across
clones (``gradients.py``), so every clone's update reads the reduced gradient.
Each segment is copied for every clone at once, as one GraphDef import
(``cloner.CopyPlan``); loops and conditions get per-clone frames and contexts
(``control_flow.py``).
"""
import tensorflow as tf

from epl import ir
from epl.rewrite import control_flow
from epl.rewrite.cloner import CopyPlan, SEED_STEP
from epl.rewrite.gradients import reduce_gradients
from epl.rewrite.selection import VARIABLE_OPS


def place_originals(state, sel):
    """The user's replica ops go to clone 0's device (shared variables and the
    single update too, when a worker shares one copy of its variables).  A write to
    a variable runs where the variable lives."""
    ops = sorted(list(sel.ops) + list(sel.shared), key=lambda o: o._id)  # pylint: disable=protected-access
    for op in ops:
        # Our placement replaces TF's colocation hints: tf.gradients colocates a
        # gradient sum with its first input, which may live on another stage.
        if "_class" in op.node_def.attr:
            op._clear_attr("_class")  # pylint: disable=protected-access
        op._set_device(_device_for(state, 0, op.inputs, op))  # pylint: disable=protected-access


def _device_for(state, c, inputs, op):
    """Clone c's device for the op's stage, unless the op takes a variable itself (a
    resource read, an update): TF keeps those on the variable's device (a shared
    variable is on clone 0's)."""
    for t in inputs:
        if ir.is_state_handle(t) and t.op.type in VARIABLE_OPS and t.op.device:
            return t.op.device
    return state.device_for(c, op)


def owned(state, op):
    """Ops a replica runs once for all its micro-batches: variables and updates."""
    return op.type in VARIABLE_OPS or op in state.selection.updates.run_once


def clone_replicas(state, sel):
    """Copy ``sel``'s ops (the replica, or what was added to it) per clone."""
    # A site whose readers are not copied (shared variables) is reduced last.
    pending = sorted(((_first_id(sel, site), site) for site in sel.updates.sites),
                     key=lambda x: (x[0], x[1].index))
    segment = []
    for op in sel.ops:
        while pending and op._id >= pending[0][0]:  # pylint: disable=protected-access
            _copy_segment(state, segment)
            segment = []
            reduce_gradients(state, pending.pop(0)[1])
        segment.append(op)
    _copy_segment(state, segment)
    for _, rec in pending:
        reduce_gradients(state, rec)
    control_flow.copy_contexts(state, sel.ops, state.copied_contexts)


def _copy_segment(state, ops):
    """Every clone's copy of ``ops`` (made in one import).  Micro-batches of a
    replica share its variables and its one update (``owned``)."""
    n = state.num_clones
    if n == 1 or not ops:
        return
    members = set(ops)
    own = set(op for op in ops if owned(state, op))
    plan = CopyPlan(state.graph)
    prefix = [state.clone_name(c, "") for c in range(n)]
    devices = {}    # (clone, variable op) -> device of the copy clone c's ops use

    def var_device(c, var):
        key = (c, var)
        if key not in devices:
            devices[key] = state.op(c, var).device
        return devices[key]

    # What every clone's copy of an op needs, computed once per op.
    templates = []
    for op in ops:
        nd = op.node_def
        own_attrs = _own_attrs(op, nd)
        inputs = []
        var = None      # the variable the op takes itself (a resource read, an update)
        for t in op.inputs:
            name = t.op.name if t.value_index == 0 else "%s:%d" % (t.op.name, t.value_index)
            inputs.append((t, name, t.op in members, t.op in own))
            if var is None and ir.is_state_handle(t) and t.op.type in VARIABLE_OPS:
                var = (t.op, t.op in members, t.op in own)
        controls = [(ci, ci.name, ci in members, ci in own) for ci in op.control_inputs]
        templates.append((op, op.name, nd, CopyPlan.template(nd, own_attrs), own_attrs, inputs,
                          controls, var, state.stage_of(op), op.type in VARIABLE_OPS,
                          op in own))

    for c in range(1, n):
        rep_c, rep = state.is_rep(c), state.reps[c]
        pre, stage_dev = prefix[c], state.stage_devices[c]

        def source(owned_op):
            """The clone whose copy clone c reads (0: the user's op)."""
            return c if not owned_op or rep_c else rep

        def refs(items, key, existing):
            """NodeDef input strings: a copy made in this plan by name, anything else
            through ``key`` (the importer maps it)."""
            out = []
            for x, xname, member, owned_x in items:
                cc = source(owned_x) if member else None
                if cc:
                    out.append(prefix[cc] + xname)
                else:
                    out.append(key(x if member else existing(c, x)))
            return out

        for op, name, nd, base, own_attrs, inputs, controls, var, stage, is_var, mine \
                in templates:
            if mine and not rep_c:
                continue
            dev = None
            if var is not None:
                v, member, owned_v = var
                cc = source(owned_v) if member else c
                dev = devices.get((cc, v)) if member and cc else var_device(cc, v)
            dev = dev or stage_dev[stage]
            if is_var:
                devices[(c, op)] = dev
            plan.add(base, pre + name, dev, refs(inputs, plan.input_key, state.tensor),
                     refs(controls, plan.control_key, state.op),
                     _attrs(state, c, op, nd) if own_attrs else None)
    made = plan.run()
    for c in sorted(range(1, n), key=lambda c: not state.is_rep(c)):
        rep_c, rep, pre, op_map = state.is_rep(c), state.reps[c], prefix[c], state.op_map[c]
        for t in templates:
            op, name, mine = t[0], t[1], t[10]
            if mine and not rep_c:
                op_map[op] = state.op_map[rep][op] if rep else op
            else:
                op_map[op] = made[pre + name]


def _own_attrs(op, nd):
    """The attributes every clone sets itself (see ``_attrs``)."""
    a = nd.attr
    keys = []
    if "seed2" in a and a["seed2"].i:
        keys.append("seed2")
    if op.type == "VarHandleOp" or ("shared_name" in a and a["shared_name"].s):
        keys.append("shared_name")
    if op.type in ("Enter", "RefEnter"):
        keys.append("frame_name")
    return keys


def _attrs(state, c, op, nd):
    """Clone c's attribute changes: its own seed stream, variable names and loop
    frames."""
    attrs = {}
    a = nd.attr
    if "seed2" in a and a["seed2"].i:
        # Stateful random ops with a fixed seed would repeat replica 0's stream.
        attrs["seed2"] = tf.compat.v1.AttrValue(i=a["seed2"].i + SEED_STEP * c)
    if op.type == "VarHandleOp":
        attrs["shared_name"] = tf.compat.v1.AttrValue(s=state.clone_name(c, op.name).encode())
    elif "shared_name" in a and a["shared_name"].s:
        attrs["shared_name"] = tf.compat.v1.AttrValue(
            s=state.clone_name(c, a["shared_name"].s.decode()).encode())
    if op.type in ("Enter", "RefEnter"):
        attrs["frame_name"] = control_flow.frame_attr(c, state, a["frame_name"])
    return attrs


def _first_id(sel, site):
    """Where to reduce ``site``: just before the first copied op that reads its
    gradients (not the gradient call's own ops), once all of them exist."""
    wanted = set(site.tensors())
    made = [t.op._id for t in wanted]  # pylint: disable=protected-access
    ids = [op._id for op in sel.ops  # pylint: disable=protected-access
           if op._id not in site.origin_ids and any(t in wanted for t in op.inputs)]  # pylint: disable=protected-access
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
            op._add_control_inputs([state.op(c, op) for c in owners])  # pylint: disable=protected-access
    for op in sel.ops:
        if not owned(state, op):
            continue
        for ci in op.control_inputs:
            if ci in whole and not owned(state, ci):
                for c in range(1, n):
                    if not state.is_rep(c):
                        state.op(state.reps[c], op)._add_control_inputs([state.op(c, ci)])  # pylint: disable=protected-access
    nodes = state.graph._nodes_by_id  # pylint: disable=protected-access
    for i in range(since + 1, state.graph._last_id + 1):  # pylint: disable=protected-access
        op = nodes.get(i)
        if op is None or op in whole or state.ir_graph.phase_of(op) == ir.REWRITE:
            continue
        extra = [state.op(c, ci) for ci in op.control_inputs if ci in whole
                 for c in range(1, n)]
        extra += [state.op(c, t.op) for t in op.inputs
                  if t.op in whole and _is_update(state, t.op) for c in owners]
        extra = [e for e in extra if e not in op.control_inputs]
        if extra:
            op._add_control_inputs(extra)  # pylint: disable=protected-access

