"""Automatic pipeline stages (``auto.auto_parallel = True`` with ``pipeline.num_stages =
K``): an unannotated model is cut into K contiguous stages, as if the user had
written K ``epl.replicate(1)`` scopes.

It runs when the first ``tf.gradients`` call (``minimize``...) is about to build
the backward pass (a backward-pass hook, ``epl.capture.backward_hooks``): the forward
pass is complete then, and the backward and update ops that follow are attributed to
the stages like those of hand-written scopes.

The cut: the forward ops the loss depends on, in creation (= topological) order,
may only be cut at a *separator* (``ir.separators``: a tensor that alone carries
everything later ops need, like a layer's output), so stages are whole layers and
data only flows from a stage to later ones.  Among those cuts, the K - 1 that
minimize the most expensive stage (dynamic programming, exact), the cost of an op
being its floating-point operations from static shapes (2mnk for a product, the
output's size for element-wise ops) — unknown dimensions (the batch) count 1, the
same for every layer.
"""
import logging

from epl import ir
from epl.capture import backward_hooks
from epl.ir.strategies import replicate
from epl.tf_adapter import graph as tfg

log = logging.getLogger("epl")

_INPUT_TYPES = frozenset(["Placeholder", "PlaceholderWithDefault", "IteratorV2", "Iterator",
                          "OneShotIterator", "MakeIterator", "AnonymousIterator",
                          "AnonymousIteratorV2"])


def check_config(config):
    """Refuse the settings auto stages cannot honour, naming the keys."""
    auto, k = config.get("auto.auto_parallel"), config.get("pipeline.num_stages")
    if k is not None and not auto:
        raise ValueError("epl.Config: 'pipeline.num_stages' = %r is only used by "
                         "'auto.auto_parallel' = True (automatic stages); set auto.auto_parallel "
                         "or annotate the stages with epl.replicate scopes." % (k,))
    if auto and k is None:
        raise NotImplementedError(
            "epl.Config: 'auto.auto_parallel' = True without 'pipeline.num_stages' asks for the "
            "strategy search, which this EPL version does not implement yet; set "
            "pipeline.num_stages to cut the model into that many pipeline stages.")
    if auto and (not isinstance(k, int) or k < 1):
        raise ValueError("epl.Config: 'pipeline.num_stages' = %r is invalid; it must be an "
                         "integer >= 1." % (k,))


def partition(graph, ys, num_stages):
    """Cut the forward ops of ``ys`` into ``num_stages`` TaskGraphs; returns the stages'
    op lists."""
    epl_graph = ir.Graph.get(graph)
    ops = _forward(epl_graph, ys)
    cuts = _cuts(ops)          # positions p: a stage may end after ops[p]
    costs = [op_cost(op) for op in ops]
    ends = best_split(costs, cuts, num_stages)
    if ends is None:
        raise ValueError(
            "epl: 'pipeline.num_stages' = %d, but the model's forward pass has only %d places "
            "where it can be cut into stages (between layers); use at most %d stages."
            % (num_stages, len(cuts), len(cuts) + 1))
    stages, start = [], 0
    for end in ends + [len(ops) - 1]:
        stages.append(ops[start:end + 1])
        start = end + 1
    total = float(sum(costs)) or 1.0
    at = 0
    for k, members in enumerate(stages):
        tg = epl_graph.taskgraph_for(replicate(1, name="auto_stage_%d" % k))
        for op in members:
            epl_graph.record(op, tg, ir.FORWARD)
        share = sum(costs[at:at + len(members)]) / total
        at += len(members)
        compute = [op for op in members if op_cost(op) > 1] or members
        log.info("EPL auto stages: stage %d = %s .. %s (%d ops, %.0f%% of the cost)", k,
                 compute[0].name, compute[-1].name, len(members), 100 * share)
    return stages


class _Hook(backward_hooks.BackwardHook):
    """``auto.auto_parallel``: the first user backward pass cuts the unannotated forward
    pass into pipeline stages before its ops are attributed to them.  After AMP: the
    stages are cut from the forward pass AMP rebuilt in half precision."""

    name = "auto_stages"
    after = ("amp",)

    def applies(self, call):
        return bool(call.config.get("auto.auto_parallel"))

    def prepare(self, call):
        epl_graph = ir.Graph.get(call.graph)
        if any(tg.strategy.name and tg.strategy.name.startswith("auto_stage_")
               for tg in epl_graph.taskgraphs):
            return
        if epl_graph.taskgraphs:
            raise ValueError(
                "epl.Config: 'auto.auto_parallel' = True cuts an unannotated model into stages, "
                "but this model has epl.replicate / epl.split annotations (%r). Remove the "
                "annotations or auto.auto_parallel." % (epl_graph.taskgraphs[0].strategy,))
        partition(call.graph, call.ys, call.config.get("pipeline.num_stages"))


backward_hooks.register(_Hook())


def _forward(epl_graph, ys):
    """The forward ops ``ys`` depend on, in creation order, without the input pipeline
    (it stays outside the stages, as in hand-annotated programs)."""
    ops = [op for op in ir.upstream([y.op for y in ys]) if epl_graph.phase_of(op) in (None, ir.FORWARD)
           and not _input(op)]
    return sorted(ops, key=tfg.op_id)


def _input(op):
    return (op.type in ir.SOURCE_OPS or op.type in _INPUT_TYPES or op.type.endswith("Dataset")
            or op.type.endswith("DatasetV2"))


def _cuts(ops):
    pos = dict((op, i) for i, op in enumerate(ops))
    return sorted(set(pos[t.op] for t in ir.separators(ops)) - set([len(ops) - 1]))


def op_cost(op):
    """Floating-point operations of ``op`` from static shapes (unknown dims count 1)."""
    def n(shape):
        if shape.ndims is None:
            return 1
        out = 1
        for d in shape.dims:
            out *= d.value if d.value is not None else 1
        return out
    if not op.outputs:
        return 1
    out = op.outputs[0]
    if op.type in ("MatMul", "BatchMatMul", "BatchMatMulV2"):
        a = op.inputs[0].shape
        transpose = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
        inner = a.dims[-2 if transpose else -1].value if a.ndims else None
        return 2 * n(out.shape) * (inner or 1)
    if op.type in ("Conv2D", "DepthwiseConv2dNative"):
        kernel = op.inputs[1].shape
        per = n(kernel) // (kernel.dims[-1].value or 1) if kernel.ndims else 1
        return 2 * n(out.shape) * per
    return n(out.shape) if out.dtype.is_floating else 1


def best_split(costs, cuts, k):
    """The ``k - 1`` cut positions (ascending, from ``cuts``) minimizing the largest
    stage cost; None when there are fewer than ``k - 1`` cuts."""
    if k == 1:
        return []
    if len(cuts) < k - 1:
        return None
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = list(cuts) + [len(costs) - 1]
    m = len(ends)

    def seg(i, j):     # cost of the ops after end i (or from 0) up to end j
        start = ends[i] + 1 if i >= 0 else 0
        return prefix[ends[j] + 1] - prefix[start]
    inf = float("inf")
    # best[s][j]: stages 0..s ending at ends[j]: the smallest largest cost, and the cut.
    best = [[(inf, None)] * m for _ in range(k)]
    for j in range(m):
        best[0][j] = (seg(-1, j), None)
    for s in range(1, k):
        for j in range(s, m):
            best[s][j] = min(((max(best[s - 1][i][0], seg(i, j)), i) for i in range(s - 1, j)),
                             key=lambda x: x[0])
    out, j = [], m - 1
    for s in range(k - 1, 0, -1):
        i = best[s][j][1]
        out.append(ends[i])
        j = i
    return sorted(out)
