"""EPL's intermediate representation over one ``tf.Graph``.

``epl.Graph`` records, while the user builds the graph, which TaskGraph each op
belongs to and in which phase it was created (forward, backward, apply,
save/restore).  Later stages ask it structural questions instead of parsing
op names.  It edits nothing itself.
"""
FORWARD, BACKWARD, APPLY, SAVE, REWRITE = "forward", "backward", "apply", "save", "rewrite"


class TaskGraph(object):
    """The ops of one strategy annotation (seed 001 §4)."""

    def __init__(self, index, strategy):
        self.index = index
        self.strategy = strategy
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
    """One ``Optimizer.apply_gradients`` call: what it got and what it made."""

    def __init__(self, grads_and_vars, global_step):
        self.grads_and_vars = grads_and_vars  # [(grad Tensor/IndexedSlices, variable)]
        self.global_step = global_step
        self.result = None                    # the op apply_gradients returned
        self.op_ids = range(0)                # ids of the ops it created
        self.computed = None                  # the compute_gradients result it came from


class Graph(object):
    """The IR of one ``tf.Graph``; ``epl.Graph.get()`` is the default graph's."""

    def __init__(self, tf_graph):
        self.tf_graph = tf_graph
        self.taskgraphs = []
        self._tg_of_strategy = {}
        self.op_taskgraph = {}    # op name -> TaskGraph or None
        self.op_phase = {}        # op name -> phase
        self.apply_records = []
        self.compute_records = []  # results of Optimizer.compute_gradients, in call order
        self.rewritten = False
        self.rewrite_result = None

    @staticmethod
    def get(tf_graph=None):
        import tensorflow as tf
        g = tf_graph if tf_graph is not None else tf.get_default_graph()
        ir = getattr(g, "_epl_graph", None)
        if ir is None:
            ir = Graph(g)
            g._epl_graph = ir
        return ir

    def taskgraph_for(self, strategy):
        tg = self._tg_of_strategy.get(id(strategy))
        if tg is None:
            tg = TaskGraph(len(self.taskgraphs), strategy)
            self.taskgraphs.append(tg)
            # Keep the strategy alive so its id() is not reused.
            self._tg_of_strategy[id(strategy)] = tg
        return tg

    def record(self, op, taskgraph, phase):
        self.op_taskgraph[op.name] = taskgraph
        self.op_phase[op.name] = phase
        if taskgraph is not None:
            taskgraph.ops.append(op)

    def taskgraph_of(self, op):
        return self.op_taskgraph.get(op.name)

    def phase_of(self, op):
        return self.op_phase.get(op.name)
