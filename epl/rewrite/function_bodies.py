"""Control flow v2 in copied replicas: which bodies each clone's loops and conditions call.

Why a module: with control flow v2 (TF 2.x's ``disable_eager_execution()`` alone, or
``enable_control_flow_v2()``) a loop or condition is one op (``While`` / ``If`` and
their stateless forms) whose bodies are functions of the graph's library
(``epl.tf_adapter.functions``).  The cloner copies the op like any other, and every
copy calls the same bodies, except where a copy needs bodies of its own
(``needs_own_bodies``, ``function_attr``):

* devices set inside a body are dropped (the body runs on its call op's device), for
  the user's op too (the ``place_original_bodies`` pass);
* a body's colocation constraints name the clone (TensorFlow groups colocated ops by
  those names across the whole graph, so two replicas' inlined bodies would be tied to
  one device);
* its seeded random ops get the clone's seed stream;
* the named resources it makes get the clone's names (as ``shared_name`` outside
  bodies).

The copies are added to the library before the ops that call them
(``add_pending_bodies``).  A loop the clones copied must not change afterwards: its
gradient extends the forward op (extra inputs and outputs, new bodies) that the
clones' copies would lack.  The ``note_copied_calls`` pass remembers each call op as
it was copied (``note_calls``); a later rewrite refuses one that changed
(``check_calls_unchanged``).
"""
from epl.tf_adapter import functions


def describe_call(op):
    """A user's name for a v2 loop or condition: 'the tf.while_loop 'rnn/while''."""
    kind = {"loop": "tf.while_loop", "branch": "tf.cond"}.get(functions.CALL_OPS[op.type],
                                                             "function call")
    if op.type in ("Case", "StatelessCase"):
        kind = "tf.case / tf.switch_case"
    return "the %s %r" % (kind, op.name)


class _Bodies(object):
    """What the rewrites of one graph did to v2 bodies."""

    def __init__(self):
        self.copies = {}      # (function, clone) -> its copy's name
        self.originals = {}   # copy's name -> function
        self.pending = []     # copies made, not yet in the library
        self.needs = {}       # (function, clone 0?) -> needs a copy (_needs_copy)
        self.calls = {}       # call op copied -> its signature then (note_calls)


def _record(graph):
    """The graph's ``_Bodies`` record."""
    rec = getattr(graph, "_epl_bodies", None)
    if rec is None:
        rec = _Bodies()
        setattr(graph, "_epl_bodies", rec)
    return rec


def _needs_copy(graph, name, clone0, memo):
    """Function ``name`` (or one it calls) needs a copy for a clone: devices set inside it
    (every clone, the user's ops too); colocation constraints, fixed random seeds or
    named shared resources (clones other than the user's)."""
    key = (name, clone0)
    if key in memo:
        return memo[key]
    memo[key] = False
    fdef = functions.function_def(graph, name)
    need = False
    for node in fdef.node_def if fdef is not None else ():
        if node.device:
            need = True
        elif not clone0 and ("_class" in node.attr or
                             ("seed2" in node.attr and node.attr["seed2"].i) or
                             ("shared_name" in node.attr and node.attr["shared_name"].s)):
            need = True
        elif any(_needs_copy(graph, n, clone0, memo) for n in functions.node_function_names(node)):
            need = True
        if need:
            break
    memo[key] = need
    return need


def needs_own_bodies(op, value, clone0=False):
    """The function-valued attribute ``value`` of the call op ``op`` names bodies that a
    clone (``clone0``: the user's own op) must have copies of."""
    graph = op.graph
    rec = _record(graph)
    originals, memo = rec.originals, rec.needs
    return any(_needs_copy(graph, originals.get(n, n), clone0, memo)
               for n in functions.attr_function_names(value))


def function_attr(state, c, value, seed_offset=0):
    """Clone c's value of a call op's function-valued attribute ``value``: the same
    functions, or the clone's copies of those that need one (``_needs_copy``), whose
    fixed random seeds (``seed2``) move by ``seed_offset`` (the cloner's seed step
    times c).  The copies are added to the library by ``add_pending_bodies``."""
    graph = state.graph
    originals = _record(graph).originals
    new = type(value)()
    new.CopyFrom(value)
    funcs = [new.func] if new.HasField("func") else list(new.list.func)
    for f in funcs:
        f.name = _copy_function(state, c, originals.get(f.name, f.name), seed_offset)
    return new


def _copy_function(state, c, name, seed_offset):
    graph = state.graph
    rec = _record(graph)
    copies, originals, pending, memo = rec.copies, rec.originals, rec.pending, rec.needs
    if not _needs_copy(graph, name, c == 0, memo):
        return name
    done = copies.get((name, c))
    if done is not None:
        return done
    fdef = functions.function_def(graph, name)
    new_name = "%s_EPL_CLONE_%d" % (name, c)
    k = 1
    while functions.has_function(graph, new_name) or new_name in originals:
        new_name = "%s_EPL_CLONE_%d_%d" % (name, c, k)
        k += 1
    copies[(name, c)] = new_name
    originals[new_name] = name
    copy = type(fdef)()
    copy.CopyFrom(fdef)
    copy.signature.name = new_name
    prefix = state.clone_name(c, "").encode()
    for node in copy.node_def:
        node.device = ""
        if c and "_class" in node.attr:
            groups = node.attr["_class"].list.s
            renamed = [b"loc:@" + prefix + g[len(b"loc:@"):] if g.startswith(b"loc:@") else g
                       for g in groups]
            del groups[:]
            groups.extend(renamed)
        if c and "seed2" in node.attr and node.attr["seed2"].i:
            # Stateful random ops with a fixed seed would repeat the user's stream.
            node.attr["seed2"].i += seed_offset
        if c and "shared_name" in node.attr and node.attr["shared_name"].s:
            # A named resource made inside a body (a table...) is the clone's own.
            node.attr["shared_name"].s = prefix + node.attr["shared_name"].s
        for value in node.attr.values():
            funcs = [value.func] if value.HasField("func") else (
                list(value.list.func) if value.HasField("list") else [])
            for f in funcs:
                f.name = _copy_function(state, c, f.name, seed_offset)
    pending.append(copy)
    return new_name


def add_pending_bodies(graph):
    """Add the body copies made since the last call to the graph's library (before the
    copies that call them are imported)."""
    pending = _record(graph).pending
    if pending:
        functions.add_function_defs(graph, pending)
        del pending[:]


def place_original_bodies(state, ops):
    """The pass ``place_original_bodies``: the user's loops and conditions of ``ops``
    (replica 0's, on their devices) whose bodies set devices call copies without them:
    a device set inside a body would override the call op's own."""
    for op in ops:
        if not functions.is_call(op):
            continue
        for k, v in functions.function_attrs(op):
            if needs_own_bodies(op, v, clone0=True):
                functions.set_attr(op, k, function_attr(state, 0, v))
    add_pending_bodies(state.graph)


def _signature(op):
    return (len(op.inputs), len(op.outputs),
            tuple(n for _, v in functions.function_attrs(op)
                  for n in functions.attr_function_names(v)))


def note_calls(state, ops):
    """The pass ``note_copied_calls``: remember the v2 loops and conditions of ``ops`` as
    the clones copied them."""
    copied = _record(state.graph).calls
    for op in ops:
        if functions.is_call(op):
            copied[op] = _signature(op)


def check_calls_unchanged(state):
    """A v2 loop or condition copied by an earlier rewrite is as it was copied.  Its
    gradient changes it (TensorFlow gives the forward ``While`` / ``If`` the values the
    gradient needs as extra outputs, and new bodies): built after the first
    session.run, the clones' copies would lack them.  Refused with the op's name."""
    copied = _record(state.graph).calls
    for op, sig in copied.items():
        if _signature(op) != sig:
            raise RuntimeError(
                "EPL: %s changed after the graph was rewritten for %d clones (%r now has "
                "%d inputs and %d outputs, %d and %d when it was copied): its gradient was "
                "built after the first session.run, and TensorFlow extends the forward op "
                "to feed it. Build the gradients and the optimizer before the first "
                "session.run." % (describe_call(op), state.num_clones, op.name,
                                  len(op.inputs), len(op.outputs), sig[0], sig[1]))
