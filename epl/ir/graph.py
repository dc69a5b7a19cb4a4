"""EPL's intermediate representation over one ``tf.Graph``.

``epl.Graph`` records, while the user builds the graph, which TaskGraph each op
belongs to and in which phase it was created (forward, backward, apply,
save/restore).  Later stages ask it structural questions instead of parsing
op names.  It edits nothing itself.
"""
from epl.tf_adapter import functions
from epl.tf_adapter import graph as tfg
FORWARD, BACKWARD, APPLY, SAVE, REWRITE = "forward", "backward", "apply", "save", "rewrite"

# Each replica pulls its own batch by running its own copy of these.
SOURCE_OPS = frozenset(["IteratorGetNext", "IteratorGetNextSync", "QueueDequeueV2",
                        "QueueDequeueManyV2", "QueueDequeueUpToV2", "QueueDequeue",
                        "QueueDequeueMany", "QueueDequeueUpTo"])


def is_batch_placeholder(op):
    """A fed placeholder whose first dimension is unknown: it holds the global batch.

    Not one whose only readers write it into variables: tf.keras's ``set_weights`` and a
    metric's ``reset_states`` (``backend.batch_set_value``) assign a value through a
    placeholder of unknown dimensions, and every copy of the variable takes all of it
    (split over the replicas, AUC's [thresholds] counts were reset to half a vector)."""
    if op.type != "Placeholder":
        return False
    shape = op.outputs[0].shape
    if shape.ndims is None or shape.ndims < 1 or shape.dims[0].value is not None:
        return False
    readers = op.outputs[0].consumers()
    return not readers or not all(r.type in _VALUE_WRITES and len(r.inputs) == 2
                                  and r.inputs[1] is op.outputs[0]
                                  and r.inputs[0] is not op.outputs[0] for r in readers)


# Ops that write their second input into the variable their first input holds.
_VALUE_WRITES = frozenset(["Assign", "AssignAdd", "AssignSub", "AssignVariableOp",
                           "AssignAddVariableOp", "AssignSubVariableOp"])


def is_batch_source(op):
    """The op pulls or holds an input batch."""
    return op.type in SOURCE_OPS or is_batch_placeholder(op)


def is_state_handle(t):
    """A ref or resource tensor: a variable (or other state) itself, not a value read
    from it."""
    return tfg.is_ref_dtype(t.dtype) or t.dtype.base_dtype.name == "resource"


def ops_since(graph, first_id):
    """The ops of ``graph`` made since the op id ``first_id``, in creation order."""
    return tfg.ops_between(graph, first_id)


def variable_bytes(op):
    """Bytes of the variable a ``VariableV2`` / ``VarHandleOp`` makes (its ``shape``
    and ``dtype`` attributes; an unknown shape counts one element)."""
    import tensorflow as tf
    shape = tf.TensorShape(op.get_attr("shape"))
    return (shape.num_elements() or 1) * tf.as_dtype(op.get_attr("dtype")).base_dtype.size


def variables_by_device(graph):
    """{device (``tf.DeviceSpec``'s canonical string; "": unplaced): bytes of the
    variables placed there} of ``graph``."""
    import collections
    import tensorflow as tf
    out = collections.Counter()
    for op in graph.get_operations():
        if op.type in ("VariableV2", "VarHandleOp"):
            where = tf.DeviceSpec.from_string(op.device).to_string() if op.device else ""
            out[where] += variable_bytes(op)
    return out


def upstream(ops, control=True, within=None, stop=()):
    """``ops`` and every op they are computed from (through data edges, and control
    edges with ``control``), staying inside ``within`` (a set, default the graph) and
    not entering ``stop``."""
    seen, stack = set(), [op for op in ops if within is None or op in within]
    while stack:
        op = stack.pop()
        if op in seen or op in stop:
            continue
        seen.add(op)
        nxt = [t.op for t in op.inputs] + (list(op.control_inputs) if control else [])
        stack.extend(p for p in nxt if within is None or p in within)
    return seen


def downstream(ops, within=None, control=True):
    """``ops`` and every op that runs after them (through data edges, and control edges
    with ``control``), staying inside ``within`` (a set, default the graph)."""
    seen, stack = set(), [op for op in ops if within is None or op in within]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        nxt = [c for t in op.outputs for c in t.consumers()]
        if control:
            nxt += list(tfg.control_outputs(op))
        stack.extend(c for c in nxt if (within is None or c in within) and c not in seen)
    return seen


def separators(ops):
    """The tensors that separate ``ops`` (a topological order): each is the only
    floating-point tensor among ``ops`` alive across its position, so what comes after
    reads what came before only through it (a plain layer's output, the residual
    stream between transformer blocks).  In order."""
    pos = {op: i for i, op in enumerate(ops)}
    last = {}
    for op in ops:
        for t in op.inputs:
            if t.op in pos and t.dtype.is_floating and not is_state_handle(t):
                last[t] = max(last.get(t, -1), pos[op])
    # Live intervals (produced, last read); t separates at p if no other crosses p.
    crossing = [0] * (len(ops) + 1)
    for t, end in last.items():
        start = pos[t.op]
        if end > start + 1:
            crossing[start + 1] += 1
            crossing[end] -= 1
    live, alone = 0, []
    for p, op in enumerate(ops):
        live += crossing[p]
        # Intervals starting at p were added at p + 1: live counts only older ones.
        if live == 0:
            outs = [t for t in op.outputs if t in last and last[t] > p]
            if len(outs) == 1:
                alone.append(outs[0])
    return alone


class TensorMap(object):
    """A dict keyed by tensors, of any graph.  TF 2.x with tensor equality (what
    ``disable_eager_execution()`` alone leaves on) gives a tensor of a function body (a
    v2 loop's or condition's) no hash, so a plain dict cannot record what capture
    learns inside a body (an ``epl.split`` layer called in a loop): the key is the
    tensor's graph and name."""

    def __init__(self):
        self._items = {}

    @staticmethod
    def _key(t):
        return (t.graph, t.name)

    def __setitem__(self, t, value):
        self._items[self._key(t)] = value

    def __getitem__(self, t):
        return self._items[self._key(t)]

    def __contains__(self, t):
        return self._key(t) in self._items

    def __len__(self):
        return len(self._items)

    def get(self, t, default=None):
        return self._items.get(self._key(t), default)


class TaskGraph(object):
    """The ops of one strategy annotation (seed 001 §4)."""

    def __init__(self, index, strategy, graph=None):
        self.index = index
        self.strategy = strategy
        self.graph = graph     # the tf.Graph whose ops these are
        self.ops = []          # in creation order

    @property
    def kind(self):
        return self.strategy.kind

    @property
    def device_count(self):
        return self.strategy.device_count or 1

    def __repr__(self):
        return "TaskGraph(%d, %r, %d ops)" % (self.index, self.strategy, len(self.ops))


class ApplyRecord(object):
    """One ``apply_gradients`` call (of any optimizer, overrides included): what it got
    and what it made."""

    def __init__(self, grads_and_vars, global_step):
        self.grads_and_vars = grads_and_vars  # [(grad Tensor/IndexedSlices, variable)]
        self.global_step = global_step
        self.result = None                    # the op apply_gradients returned
        self.across_runs = False              # accumulates across session runs
        self.op_ids = range(0)                # ids of the ops it created


class GradientRecord(object):
    """One ``tf.gradients`` (also ``compute_gradients``, ``GradientTape.gradient``) call:
    ``grads[i]`` is the gradient of ``ys`` with respect to ``xs[i]`` (or None)."""

    def __init__(self, ys, xs, grads, op_ids):
        self.ys = ys
        self.xs = xs
        self.grads = grads
        self.op_ids = op_ids                  # ids of the ops it created

    def tensors(self):
        """Every gradient tensor (IndexedSlices count with their components)."""
        out = []
        for g in self.grads:
            out.extend(components(g))
        return out


def components(g):
    """The tensors of a gradient value: itself, or an IndexedSlices' values and indices."""
    if g is None:
        return []
    if hasattr(g, "indices") and hasattr(g, "values"):
        return [g.values, g.indices]
    return [g]


class RewriteLifecycle(object):
    """Where the rewrite of one graph stands (written by ``epl.rewrite.rewrite``)."""

    def __init__(self):
        self.rewritten = False
        self.pending = False        # model ops were added since the last rewrite
        self.result = None          # the last rewrite's RewriteResult
        self.error = None           # the exception a failed rewrite raised


class Graph(object):
    """The IR of one ``tf.Graph``; ``epl.Graph.get()`` is the default graph's."""

    def __init__(self, tf_graph):
        self.tf_graph = tf_graph
        self.taskgraphs = []
        self._tg_of_strategy = {}
        self.op_taskgraph = {}    # op name -> TaskGraph or None
        self.op_phase = {}        # op name -> phase
        self.op_shard = {}        # op name -> shard index (ops of a split TaskGraph's shards)
        self.sharded = TensorMap()  # logical tensor -> epl.tensor_parallel.sharding.Sharded
        self.apply_records = []
        self.gradient_records = []  # every tf.gradients call, in call order
        self.relaxed = {}           # batch-relaxing op name -> the tensor it relaxes
        self.relax_cache = {}       # (tensor name, taskgraph index) -> relaxed view
        self._batch_memo = {}       # op name -> computed from a batch (capture time)
        # (tensor, {state variable op name: aggregation}): values computed from per-replica
        # state (tf.keras metric results, epl.capture.keras_reports); merged by epl.rewrite.merge
        self.state_results = []
        self.lifecycle = RewriteLifecycle()
        self._features = {}

    def feature(self, cls):
        """The state of one feature for this graph: an instance of ``cls`` (the
        feature's own small class, made with no arguments on first use).  Features keep
        what they need per graph here (``epl.features.amp.AmpState``...), typed and named by
        their class, instead of attributes set on the IR."""
        state = self._features.get(cls)
        if state is None:
            state = self._features[cls] = cls()
        return state

    # The rewrite's lifecycle, read and written by the runtime layer under these names.
    rewritten = property(lambda self: self.lifecycle.rewritten,
                         lambda self, v: setattr(self.lifecycle, "rewritten", v))
    pending = property(lambda self: self.lifecycle.pending,
                       lambda self, v: setattr(self.lifecycle, "pending", v))
    rewrite_result = property(lambda self: self.lifecycle.result)
    rewrite_error = property(lambda self: self.lifecycle.error)

    @staticmethod
    def get(tf_graph=None):
        """The IR of ``tf_graph`` (default: the default graph), made on first use."""
        import tensorflow as tf
        g = tf_graph if tf_graph is not None else tf.compat.v1.get_default_graph()
        ir = getattr(g, "_epl_graph", None)
        if ir is None:
            ir = Graph(g)
            g._epl_graph = ir
        return ir

    @staticmethod
    def existing(tf_graph):
        """The IR of ``tf_graph`` if EPL has recorded anything in it, else None."""
        return getattr(tf_graph, "_epl_graph", None)

    @staticmethod
    def forget(tf_graph):
        """Drop what EPL recorded of ``tf_graph`` (annotations laid out for an old
        cluster)."""
        if getattr(tf_graph, "_epl_graph", None) is not None:
            del tf_graph._epl_graph

    def taskgraph_for(self, strategy):
        tg = self._tg_of_strategy.get(id(strategy))
        if tg is None:
            tg = TaskGraph(len(self.taskgraphs), strategy, self.tf_graph)
            self.taskgraphs.append(tg)
            # Keep the strategy alive so its id() is not reused.
            self._tg_of_strategy[id(strategy)] = tg
        return tg

    def record(self, op, taskgraph, phase, shard=None):
        self.op_taskgraph[op.name] = taskgraph
        self.op_phase[op.name] = phase
        if shard is not None:
            self.op_shard[op.name] = shard
        # Only the graph's own ops join its TaskGraphs: an op of a v2 body (a FuncGraph)
        # made while a gradient of this graph was built (TF 1.15 rebuilds a loop's bodies
        # from their FunctionDefs inside tf.gradients) is classified with the gradient's
        # TaskGraph, but its tensors exist only inside the body: no pass may copy it.
        if taskgraph is not None and (taskgraph.graph is None
                                      or taskgraph.graph is self.tf_graph):
            taskgraph.ops.append(op)

    def add_gradient_record(self, record):
        """Record one finished ``tf.gradients`` (or tape) call of this graph, and what
        TensorFlow made in it for the forward loops (``adopt_loop_inputs``)."""
        self.gradient_records.append(record)
        if record.op_ids:
            self.adopt_loop_inputs(record.op_ids[0])

    def adopt_loop_inputs(self, first_id):
        """The ops made since the op id ``first_id`` (one gradient call) for a forward
        v2 loop are the forward pass of the loop's TaskGraph.

        A v2 loop's gradient pushes the forward values it needs onto lists (TensorList
        accumulators) that TensorFlow adds to the forward ``While`` as extra inputs,
        made while the gradient is built.  Capture classifies them as backward ops, of
        the body graph's own TaskGraph when they are made while a body's gradient is
        built (TF 2.x; that TaskGraph's ops are the body's, so the accumulators would
        be in no TaskGraph of this graph): not copied per clone nor placed, and a
        pipeline's schedule (every backward after the forwards of the micro-batches)
        would make the forward loop wait for its own backward, a cycle.  Here, at the
        end of the gradient call that made them, they join the loop's TaskGraph as
        forward ops, where every later reader of the IR (the rewrite's selection, a
        later rewrite of ops built after the first run, the planner) finds them.

        Only ops of this call that feed nothing but forward loops and conditions (their
        recomputations by gradient checkpointing, and each other) are taken: a gradient
        a forward condition reads (a gradient penalty) was made by an earlier call and
        stays the backward op it is."""
        made = tfg.ops_between(self.tf_graph, first_id)
        if not made:
            return
        mine = set(made)
        ours = set(id(tg) for tg in self.taskgraphs)

        def forward_call(op):
            return functions.is_call(op) and self.phase_of(op) == FORWARD

        def bodies(op):
            return tuple(n for _, v in functions.function_attrs(op)
                         for n in functions.attr_function_names(v))

        def for_loops(op, adopted):
            """Every reader of ``op`` is adopted, a forward call, or a copy of a forward
            call that reads ``op`` too (gradient checkpointing's recomputation of a
            loop calls the same bodies)."""
            users = tfg.users(op)
            forward = set(bodies(u) for u in users if forward_call(u))
            return all(u in adopted or forward_call(u)
                       or (functions.is_call(u) and bodies(u) in forward) for u in users)
        calls = tfg.by_id(set(u for op in made for u in tfg.users(op) if forward_call(u)))
        for call in calls:
            tg = self.taskgraph_of(call)
            if tg is None or id(tg) not in ours:
                continue
            moved, adopted = [], set()
            stack = [t.op for t in call.inputs if t.op in mine]
            while stack:
                up = stack.pop()
                if up in adopted or up not in mine:
                    continue
                owner = self.taskgraph_of(up)
                foreign = owner is not None and id(owner) not in ours
                if self.phase_of(up) != BACKWARD and not foreign:
                    continue
                if not for_loops(up, adopted):
                    continue
                adopted.add(up)
                self.op_phase[up.name] = FORWARD
                if owner is not tg:
                    if not foreign and owner is not None and up in owner.ops:
                        owner.ops.remove(up)
                    self.op_taskgraph[up.name] = tg
                    moved.append(up)
                stack.extend(t.op for t in up.inputs)
            if moved:
                tg.ops[:] = tfg.by_id(tg.ops + moved)

    def stage_order(self, taskgraphs=None):
        """Position of every TaskGraph (of ``taskgraphs``, default all) in the pipeline:
        {taskgraph index: stage}.

        Stages follow the forward data flow between TaskGraphs (creation order
        breaks ties).  A cycle (each of two scopes reads the other's output)
        cannot be pipelined and raises ValueError naming both directions.
        """
        taskgraphs = list(self.taskgraphs if taskgraphs is None else taskgraphs)
        members = set(tg.index for tg in taskgraphs)
        example = {}
        for tg in taskgraphs:
            for op in tg.ops:
                if self.phase_of(op) != FORWARD:
                    continue
                for t in op.inputs:
                    src = self.taskgraph_of(t.op)
                    if (src is not None and src is not tg and src.index in members
                            and self.phase_of(t.op) == FORWARD):
                        example.setdefault((src.index, tg.index), (t.name, op.name))
        succ = {tg.index: set() for tg in taskgraphs}
        indeg = {tg.index: 0 for tg in taskgraphs}
        for (a, b) in example:
            if b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
        order, ready = [], sorted(i for i, d in indeg.items() if d == 0)
        while ready:
            i = ready.pop(0)
            order.append(i)
            for j in sorted(succ[i]):
                indeg[j] -= 1
                if indeg[j] == 0:
                    ready.append(j)
                    ready.sort()
        if len(order) != len(taskgraphs):
            stuck = [i for i in indeg if indeg[i] > 0]
            pairs = ["%r reads %r (op %r)" % (self.taskgraphs[b].strategy, example[(a, b)][0],
                                              example[(a, b)][1])
                     for (a, b) in sorted(example) if a in stuck and b in stuck]
            raise ValueError(
                "EPL: the annotated scopes cannot be ordered as pipeline stages; they read each "
                "other's outputs in a cycle: %s. Each stage may only read earlier stages: put "
                "the ops of the cycle into one scope." % "; ".join(pairs))
        return {tg_index: stage for stage, tg_index in enumerate(order)}

    def is_batch(self, op):
        """``op`` is computed from an input batch.  While the graph is built (ops and
        their inputs do not change yet), so the answer is kept."""
        memo = self._batch_memo
        stack, on_stack = [op], set([op.name])
        while stack:
            cur = stack[-1]
            if cur.name in memo:
                stack.pop()
                on_stack.discard(cur.name)
                continue
            if is_batch_source(cur):
                memo[cur.name] = True
                continue
            pending = [t.op for t in cur.inputs
                       if t.op.name not in memo and t.op.name not in on_stack]
            if pending:
                stack.extend(pending)
                on_stack.update(p.name for p in pending)
                continue
            memo[cur.name] = any(memo.get(t.op.name, False) for t in cur.inputs)
        return memo[op.name]

    def taskgraph_of(self, op):
        return self.op_taskgraph.get(op.name)

    def shard_of(self, op):
        """The shard of a split TaskGraph that runs ``op`` (None: the split's first device)."""
        return self.op_shard.get(op.name)

    def phase_of(self, op):
        return self.op_phase.get(op.name)
