"""The peak of a training step's transient memory, by walking its ops in order.

Summing every activation the backward pass reads and every gradient over-predicts a
step's peak: TensorFlow frees a forward tensor after its last reader, so by the time
the backward pass has produced the last gradients most activations are gone (measured
11-21 % above the traced peak on the corpus models, issue 36).  ``peak_bytes`` replays
the step instead, on the graph the session really runs (``tf_adapter.grappler``): the
ops in the order a dataflow executor runs them (an op once its inputs are ready; the
updates as soon as their gradient is made, or, under data parallelism, after all
gradients), each output allocated when its op runs and freed after its last reader,
with the two ways TensorFlow's CPU kernels avoid an allocation:

* views (``Identity``, ``Reshape``, an identity ``Transpose``) share their input's
  buffer;
* element-wise kernels write into an input whose last reader they are, when it has the
  output's size (``forward_input_or_allocate_output``).

and the one scratch buffer that matters on the CPU: a convolution's gradient kernels
unfold patches into up to ~30 MiB while they run (``scratch_bytes``; the two gradients
of one convolution are ready together and may run side by side).

Variables and constants are not step allocations (the caller adds the variables);
update ops write into their variables.  The result is the peak of the live bytes at
the graph's built batch.
"""
import collections

import tensorflow as tf

from epl.tf_adapter import graph as tfg
from epl.tf_adapter import version

_VIEWS = frozenset(["Identity", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                    "Snapshot", "PreventGradient", "IdentityN", "RefIdentity",
                    "EnsureShape", "CheckNumerics"])
# Kernels that reuse an input buffer they are the last reader of (same size)
_IN_PLACE = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "Neg", "Relu", "ReluGrad", "Relu6", "Relu6Grad", "Elu", "EluGrad", "Selu", "SeluGrad",
    "Tanh", "TanhGrad", "Sigmoid", "SigmoidGrad", "Exp", "Log", "Log1p", "Sqrt",
    "SqrtGrad", "Rsqrt", "RsqrtGrad", "Square", "SquaredDifference", "Pow", "Reciprocal",
    "ReciprocalGrad", "AddN", "BiasAdd", "Erf", "Softplus", "SoftplusGrad", "Abs",
    "Sign", "Floor", "Ceil", "Round", "LeakyRelu", "LeakyReluGrad", "Inv", "InvGrad"])
# Kernels that keep the cores busy (a device is alone once no other device runs one)
_HEAVY = ("MatMul", "BatchMatMul", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
          "_FusedMatMul", "_FusedConv2D", "Einsum")
_NO_ALLOCATION = frozenset(["Const", "VariableV2", "VarHandleOp", "Variable",
                            "Placeholder", "PlaceholderWithDefault", "NoOp",
                            "ReadVariableOp", "Assert"])


# EPL's in-process collectives write their result into one buffer per group, kept from
# step to step (csrc/collectives.cc, AllocateShared: from 64 KiB): not a step's
# allocation (docs/plan.md, limits)
_KEPT_OUTPUT = 1 << 16


def _kept_across_steps(op):
    try:
        return op.get_attr("transport") in (b"inprocess", "inprocess") \
            and op.get_attr("group") is not None and op.get_attr("size") > 1
    except ValueError:
        return False


_REDUCTIONS = ("EplAllReduce", "EplAllReduceN")


def _passes_through(op):
    """An EPL all-reduce of a group of one rank in this process (a replica alone: data
    parallelism on one device): its outputs are its inputs (csrc/ops.cc), so each
    input lives until the output's last reader (under data parallelism every update
    waits for every reduced gradient: the step holds them all)."""
    if op.type not in _REDUCTIONS:
        return False
    try:
        return op.get_attr("size") == 1 \
            and op.get_attr("transport") in (b"inprocess", "inprocess")
    except ValueError:
        return False


def _is_view(op):
    """A view op, or a transpose that keeps the order (TensorFlow's graph optimizer
    removes it: ``tf.tensordot`` makes one per product)."""
    if op.type in _VIEWS:
        return True
    if op.type == "Transpose":
        perm = tf.get_static_value(op.inputs[1])
        return perm is not None and list(perm) == list(range(len(perm)))
    return False


# TensorFlow's CPU kernels for a convolution's gradients unfold image patches into a
# scratch buffer sized to a ~30 MiB working set (conv_grad_{input,filter}_ops.cc: whole
# images per shard, the patches' share of each image's work), freed when they return
_CONV_GRADS = ("Conv2DBackpropInput", "Conv2DBackpropFilter")
_WORKING_SET = 30 << 20
# ... except the input gradient of a large convolution per image, which goes one image
# at a time (traced here: per-image work of 29,696-39,424 elements took whole-shard
# buffers, 152,576-253,952 one image's patches; the threshold between, in elements)
_PARALLEL_IMAGE = 1 << 17


def scratch_bytes(op):
    """Bytes a kernel allocates for itself while it runs (0 where none is known;
    oneDNN's convolution gradients, TF 2.x on AVX-512 CPUs, allocate none of
    TensorFlow's: traced)."""
    if op.type not in _CONV_GRADS or version.onednn_enabled():
        return 0
    grad = op.inputs[2].shape                     # [batch, out_h, out_w, out_depth]
    filt = op.inputs[1].shape if op.type == "Conv2DBackpropInput" else op.outputs[0].shape
    if not (grad.is_fully_defined() and filt.is_fully_defined()) or grad.rank != 4:
        return 0
    _, out_h, out_w, out_depth = grad.as_list()
    k_h, k_w, in_depth, _ = filt.as_list()
    size = op.inputs[2].dtype.size
    patches = out_h * out_w * k_h * k_w * in_depth
    work = patches + out_h * out_w * out_depth + k_h * k_w * in_depth * out_depth
    images = -(-(_WORKING_SET // size) // work)
    if op.type == "Conv2DBackpropInput" and work >= _PARALLEL_IMAGE:
        images = 1      # one image at a time, its product split over the threads
    return images * patches * size


def tensor_bytes(t, rows):
    """Bytes of tensor ``t`` at ``rows`` rows (0: references, handles, strings)."""
    if tfg.is_ref_dtype(t.dtype) or t.dtype == tf.resource or t.dtype == tf.variant \
            or t.dtype == tf.string:
        return 0
    shape = t.shape
    if shape.rank is None:
        return t.dtype.size
    n = 1
    for d in shape.as_list():
        n *= rows if d is None else int(d)
    return n * t.dtype.size


def is_update(op):
    return op.type.startswith(("Apply", "ResourceApply", "Assign", "ResourceScatter",
                               "ScatterAdd", "ScatterSub", "ScatterUpdate"))


def rendezvous(ops):
    """{op: its meeting}: EPL's collectives (ops with ``group``, ``rank`` and ``size``
    attributes) block until every rank of their group has joined, so they run
    together; the k-th op of each rank of a (type, group) is its k-th meeting (ops in
    creation order).  A group with ranks outside ``ops`` (other workers) is left out."""
    ranks = collections.defaultdict(lambda: collections.defaultdict(list))
    sizes = {}
    for op in ops:
        try:
            group, rank, size = (op.get_attr(a) for a in ("group", "rank", "size"))
        except ValueError:
            continue
        ranks[(op.type, group)][rank].append(op)
        sizes[(op.type, group)] = size
    meeting = {}
    for key, per_rank in ranks.items():
        if len(per_rank) != sizes[key] or sizes[key] < 2:
            continue
        for rank_ops in per_rank.values():
            for k, op in enumerate(rank_ops):
                meeting[op] = (key, k)
    return meeting


def dataflow_order(ops, updates_last=False):
    """``ops`` in the order a dataflow executor runs them: an op as soon as its inputs
    are ready, ready ops first in, first out (ties in creation order); the ranks of a
    collective together, once the last of them is ready (their inputs held until then:
    the micro-batches' gradients of a pipeline wait for their sum).
    ``updates_last``: the updates wait until nothing else is ready (data parallelism:
    the gradients are all made before their fused all-reduce, then applied)."""
    member = set(ops)
    rank = dict((op, i) for i, op in enumerate(ops))
    meeting = rendezvous(ops)
    members = collections.Counter(meeting.values())
    joined = collections.defaultdict(list)
    waiting = {}
    after = collections.defaultdict(list)
    for op in ops:
        deps = set(t.op for t in op.inputs if t.op in member) | set(
            c for c in op.control_inputs if c in member)
        waiting[op] = len(deps)
        for d in deps:
            after[d].append(op)
    queue = collections.deque()
    held = collections.deque()

    def ready(op):
        if op in meeting:
            key = meeting[op]
            joined[key].append(op)
            if len(joined[key]) == members[key]:
                queue.extend(sorted(joined[key], key=rank.get))
        else:
            (held if updates_last and is_update(op) else queue).append(op)
    for op in ops:
        if not waiting[op]:
            ready(op)
    out = []
    while queue or held:
        op = queue.popleft() if queue else held.popleft()
        out.append(op)
        for nxt in sorted(after[op], key=rank.get):
            waiting[nxt] -= 1
            if not waiting[nxt]:
                ready(nxt)
    return out


def peak_bytes(ops, rows, updates_last=False, side_by_side=True, trace=None, share=None):
    """The peak of the live bytes while ``ops`` run (a list of ``tf.Operation`` in
    creation order; tensors of ops outside it are inputs already there: not counted)
    in ``dataflow_order``.  ``rows``: the size of an unknown dimension.
    ``side_by_side``: an op's scratch overlaps the previous op's (a device with the
    cores to itself runs ready kernels together; traced: one device held both
    gradient kernels' buffers of a convolution, each of 2 devices on 2 cores one at a
    time).  ``trace``: a list that gets [(op at the peak, [(bytes, buffer) alive])].
    ``share``: tensor -> the part of its bytes one device holds (the whole model's step
    walked as its tensor-parallel split: ``step_graph.split_share``)."""
    at = {} if trace is not None else None
    peak = _walk(dataflow_order(ops, updates_last), rows, side_by_side, at, share=share)
    if trace is not None:
        trace[:] = list(at.values())
    return peak


def device_peaks(ops, rows, device_of, trace=None):
    """{device: the peak of its live bytes} for a step placed over the virtual CPU
    devices of one process (a pipeline's stages on ``Cluster.local``): the whole step
    walked in one ``dataflow_order`` (the schedule's control edges order each device's
    micro-batches).  Those devices share the host's memory: a tensor another device
    reads is not copied (traced: a stage's last convolution held the next stage's
    activations, which its ReLU had written in place), so a buffer counts on the
    device that made it until its last reader anywhere.  A device's kernels run one at
    a time while other devices work beside it (they share the cores), side by side
    once it is the last one working: after every other device's last heavy kernel
    (traced: a ResNet's first stage ran both gradients of a convolution together,
    their scratch at once, in its last micro-batch's backward pass).
    ``device_of``: op -> device; ``trace``: see ``_walk``."""
    order = dataflow_order(ops)
    heavy = [i for i, op in enumerate(order) if op.type.startswith(_HEAVY)]
    last_other = {}
    for dev in set(device_of(op) for op in order):
        others = [i for i in heavy if device_of(order[i]) != dev]
        last_other[dev] = others[-1] if others else -1
    position = dict((op, i) for i, op in enumerate(order))
    return _walk(order, rows, lambda op: position[op] > last_other[device_of(op)], trace,
                 device_of)


def _walk(ops, rows, side_by_side, trace, device_of=None, share=None):
    """The peak of the live bytes while ``ops`` run in this order ({device: peak} with
    ``device_of``: op -> device; a buffer counts on its maker's device); ``side_by_side``:
    a bool, or op -> whether its scratch may overlap the previous op's on its device;
    ``trace``: a dict that gets {device: (op at its peak, [(bytes, buffer) alive there])};
    ``share``: tensor -> the part of its bytes counted (``peak_bytes``)."""
    where = device_of or (lambda op: None)
    ops = [op for op in ops if op.type not in _NO_ALLOCATION]
    views = set(op for op in ops if _is_view(op) or _passes_through(op))
    buffer_of, size, readers, owner = {}, {}, {}, {}  # tensor -> buffer; buffer -> ...
    for op in ops:
        for t in op.outputs:
            # (a view's first output is its first input; a pass-through's each its own)
            k = t.value_index if op.type in _REDUCTIONS else 0
            if op in views and t.value_index == k and op.inputs[k] in buffer_of:
                buffer_of[t] = buffer_of[op.inputs[k]]
                continue
            buffer_of[t] = t        # (a view of a variable or an input holds no bytes)
            size[t] = 0 if op in views else tensor_bytes(t, rows)
            if size[t] >= _KEPT_OUTPUT and _kept_across_steps(op):
                size[t] = 0
            if share is not None:
                size[t] = int(size[t] * share(t))
            readers[t] = set()
    for op in ops:
        if op in views:             # views read on behalf of their outputs' readers
            continue
        for t in op.inputs:
            if t in buffer_of:
                readers[buffer_of[t]].add(op)
    live, peak = collections.Counter(), collections.Counter()
    alive = set()
    before = {}                     # each device's previous scratch: they may overlap
    for op in ops:
        dev = where(op)
        freed = []
        for t in set(op.inputs):
            b = buffer_of.get(t)
            if b is not None and op in readers[b]:
                readers[b].discard(op)
                if not readers[b]:
                    freed.append(b)
        for t in op.outputs:
            if buffer_of[t] is not t:
                continue
            alive.add(t)
            same = [f for f in freed if size[f] == size[t]] if op.type in _IN_PLACE \
                else []
            if same:                # written into an input it was the last reader of
                freed.remove(same[0])
                alive.discard(same[0])
                owner[t] = owner[same[0]]
            else:
                owner[t] = dev
                live[dev] += size[t]
            if not readers[t]:      # read by nobody: freed with the op's inputs
                freed.append(t)
        scratch = scratch_bytes(op)
        if live[dev] + scratch + before.get(dev, 0) > peak[dev]:
            peak[dev] = live[dev] + scratch + before.get(dev, 0)
            if trace is not None:
                trace[dev] = (op.name, sorted(((size[b], b.name) for b in alive
                                               if owner[b] == dev), reverse=True))
        for b in freed:
            alive.discard(b)
            live[owner[b]] -= size[b]
        together = side_by_side(op) if callable(side_by_side) else side_by_side
        before[dev] = scratch if together else 0
    return dict(peak) if device_of else peak[None]
