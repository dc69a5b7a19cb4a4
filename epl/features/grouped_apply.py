"""Grouped apply (seed 001 §6.6, ``optimizer.num_apply_group``): the optimizer's
updates run in groups, one group after another, so the temporaries one group
allocates are freed before the next allocates its own.  Numbers do not change:
each update reads the same gradient, variable and slots as before.

It runs when an ``apply_gradients`` call has built its ops (an apply-path hook,
``epl.capture.apply_hooks``, named "grouped_apply", after "accumulate" and "amp"), on
whatever ops the optimizer made (its own
``_apply_dense``, a user's override computing its update by hand, a keras
optimizer): the ops of a group are the ones computed from that group's gradients
only, and the ops only those read; ops computed from several groups' gradients
(a global-norm, the step counter, Adam's beta powers) are left as they are.  Group k + 1's first ops wait
(control edges) for group k's last ones.
"""
import logging

from epl import ir
from epl.capture import apply_hooks
from epl.tf_adapter import graph as tfg

log = logging.getLogger("epl")


def apply(graph, grads_and_vars, first_id, num_groups):
    """Order the update ops (ids ``first_id``..) of ``grads_and_vars`` in
    ``num_groups`` groups; returns the groups' sizes (variables per group)."""
    made = ir.ops_since(graph, first_id)
    if num_groups <= 1 or not made:
        return []
    mine = set(made)
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    # The order the backward pass makes the gradients in: the last layers' first.
    pairs.reverse()
    groups = _balanced(pairs, num_groups)
    if len(groups) < 2:
        return []
    owner = {}      # op -> group index, or -1 when computed from several groups
    for k, group in enumerate(groups):
        starts = [t.op for g, _ in group for t in ir.components(g)]
        readers = [c for g, _ in group for t in ir.components(g) for c in t.consumers()]
        for op in ir.downstream(readers, mine):
            owner[op] = k if owner.get(op, k) == k else -1
        for op in starts:
            if op in mine:
                owner[op] = k if owner.get(op, k) == k else -1
    _pull_in_feeders(made, owner)
    members = [[op for op in made if owner.get(op) == k] for k in range(len(groups))]
    for k in range(1, len(groups)):
        if not members[k] or not members[k - 1]:
            continue
        previous = set(members[k - 1])
        current = set(members[k])
        lasts = [op for op in members[k - 1]
                 if not any(c in previous for t in op.outputs for c in t.consumers())
                 and not any(c in previous for c in tfg.control_outputs(op))]
        firsts = [op for op in members[k]
                  if not any(t.op in current for t in op.inputs)
                  and not any(c in current for c in op.control_inputs)]
        for op in firsts:
            tfg.add_control_inputs(op, lasts)
    sizes = [len(group) for group in groups]
    log.info("EPL grouped apply: %d variables in %d groups %s", len(pairs), len(groups), sizes)
    return sizes


def _pull_in_feeders(made, owner):
    """An op of the call that only one group's ops read (``0.9 * m`` of a slot, the
    weight-decay term ``c * w``) runs with that group: it would otherwise run for
    every variable at once, as soon as it can, and hold its temporary until its
    group comes.  Reads of a variable stay out of the groups (fetching a variable
    must not wait for anyone's update), as do constants."""
    changed = True
    while changed:
        changed = False
        for op in reversed(made):
            if op in owner or op.type == "Const" or not op.inputs \
                    or any(ir.is_state_handle(t) for t in list(op.inputs) + list(op.outputs)):
                continue
            users = [c for t in op.outputs for c in t.consumers()] + list(tfg.control_outputs(op))
            kinds = set(owner.get(u) for u in users)
            if len(kinds) == 1 and None not in kinds and -1 not in kinds:
                owner[op] = kinds.pop()
                changed = True


def _balanced(pairs, num_groups):
    """Consecutive groups of about equal variable bytes (at most one per variable)."""
    sizes = [max(v.shape.num_elements() or 1, 1) * max(v.dtype.base_dtype.size, 1)
             for _, v in pairs]
    total = float(sum(sizes))
    n = min(num_groups, len(pairs))
    groups, cur, acc = [], [], 0.0
    for (pair, size), left in zip(zip(pairs, sizes), range(len(pairs), 0, -1)):
        cur.append(pair)
        acc += size
        need = n - len(groups) - 1      # groups still to open after this one
        if need > 0 and (acc >= total * (len(groups) + 1) / n or left - 1 == need):
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


class _Hook(apply_hooks.ApplyHook):
    """Grouped apply's part in a user's ``apply_gradients`` (``optimizer.num_apply_group >
    1``): once the call's ops are built (the gates of the hooks before it included),
    they run in groups."""

    name = "grouped_apply"
    after = ("accumulate", "amp")   # groups the ops they build too

    def applies(self, call):
        return call.config.get("optimizer.num_apply_group") > 1

    def finish(self, call):
        apply(call.graph, call.grads_and_vars, call.first_id,
              call.config.get("optimizer.num_apply_group"))


apply_hooks.register(_Hook())
