"""A model's own kernels (matrix products, convolutions and the other ops a step runs),
timed one by one on this machine.

FLOPs over a peak miss by 2-3x on EPL's CPU devices: a model's products are thin (64
rows), batched (attention's 128 x 64 matrices) or convolutions whose gradient kernels
unfold patches, and how well one of them spreads over the cores depends on its shape
(measured: a lone device ran the GPT decoder 2.4x slower per row than two devices
running one replica each).  So ``Cluster.local`` prices the products of a model the way
Proteus and DistSim price ops: each distinct one (type, shapes, attributes; forward and
gradient kernels alike, read from the built graph by ``graph_profile``) is built alone
with random inputs and timed

* ``alone``: one device with the machine's cores to itself;
* ``shared``: as many devices as cores, each running a copy at once (the per-device
  time when every device is busy; more devices than cores take turns).

The other kernels of a step (batch norm and its gradient, pooling, ReLU gradients,
padding, the loss...: on a conv net a third of the step, where a bytes-over-bandwidth
roofline missed it by 30 %) are timed the same way (``kernel_signature``): the op's own
NodeDef is imported alone, its float inputs random variables of their static shapes,
its integer inputs their static values (shapes, axes, paddings) or zeros (labels,
indices).  What cannot be rebuilt (unknown shapes, state, control flow, functions) is
left to the roofline.

Results are cached beside the calibration (``<cache>-products.json``), keyed by the
kernel's signature, so a model is timed once per machine.  A product that cannot be
built alone (an einsum, explicit padding) is left to the FLOP model; a kernel that
fails to run alone is cached as untimed (None).
"""
import base64
import json
import os
import time

import numpy as np
import tensorflow as tf

from epl.auto import local

v1 = tf.compat.v1
PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropInput",
            "Conv2DBackpropFilter")
# ops that are no kernel worth timing: views, shape arithmetic, state
_NOT_KERNELS = frozenset((
    "Const", "Identity", "IdentityN", "NoOp", "Shape", "ShapeN", "Size", "Rank", "Reshape",
    "Squeeze", "ExpandDims", "StopGradient", "PreventGradient", "BroadcastGradientArgs",
    "Placeholder", "PlaceholderWithDefault", "Snapshot", "ReadVariableOp", "Enter", "Exit",
    "Merge", "Switch", "NextIteration", "LoopCond"))
_MAX_STATIC = 64        # integer inputs up to this many elements are kept as values
_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "strides", "padding",
          "data_format", "dilations")


def signature(op, rows):
    """A JSON-able key of a product op at ``rows`` rows, or None when it is not one
    we can time (unknown shapes, explicit padding, not a float type)."""
    if op.type not in PRODUCTS:
        return None
    dtype = op.outputs[0].dtype
    if dtype not in (tf.float32, tf.bfloat16, tf.float16):
        return None
    shapes = []
    for i, t in enumerate(list(op.inputs) + [op.outputs[0]]):
        if t.shape.rank is None:
            return None
        dims = [rows if d is None else int(d) for d in t.shape.as_list()]
        shapes.append(dims)
    attrs = {}
    for name in _ATTRS:
        if name in op.node_def.attr:
            value = op.get_attr(name)
            attrs[name] = value.decode() if isinstance(value, bytes) else value
    if attrs.get("padding") not in (None, "SAME", "VALID"):
        return None
    if dtype != tf.float32:         # AMP's half-precision products (float32: no key)
        attrs["T"] = dtype.name
    return json.dumps([op.type, shapes, attrs], sort_keys=True)


def kernel_signature(op, rows):
    """A JSON-able key of any other op a step runs at ``rows`` rows (its NodeDef, its
    inputs' dtypes and shapes, the values of its integer inputs), or None where it is
    not a kernel to time: a view, state, control flow, a function, a non-float result,
    unknown shapes."""
    if op.type in PRODUCTS or op.type in _NOT_KERNELS or op.op_def.is_stateful \
            or not op.outputs or not op.outputs[0].dtype.is_floating:
        return None
    if any(v.HasField("func") or len(v.list.func) for v in op.node_def.attr.values()):
        return None
    inputs = []
    for t in op.inputs:
        dtype = t.dtype
        if dtype == tf.resource or dtype.base_dtype != dtype or dtype == tf.variant:
            return None
        dims = None         # unknown rank: an empty tensor (batch norm's unused reserve)
        if t.shape.rank is not None:
            if any(d is None for d in t.shape.as_list()[1:]):
                return None
            dims = [rows if d is None else int(d) for d in t.shape.as_list()]
        value = None
        if dtype.is_integer or dtype == tf.bool:
            value = _static(t)
            if value is not None:
                if value.size > _MAX_STATIC:
                    return None
                value = value.tolist()
            elif dims is None:
                return None
        elif not dtype.is_floating:
            return None
        inputs.append([dtype.name, dims, value])
    node = v1.NodeDef()
    node.op = op.type
    for name, value in op.node_def.attr.items():
        if not name.startswith("_"):
            node.attr[name].CopyFrom(value)
    blob = base64.b64encode(node.SerializeToString(deterministic=True)).decode()
    return json.dumps(["kernel", op.type, blob, inputs])


def any_signature(op, rows):
    """The op's product signature, else its kernel signature, else None."""
    return signature(op, rows) or kernel_signature(op, rows)


def _static(t):
    """An integer tensor's value where the graph fixes it (shapes, axes), else None."""
    value = tf.get_static_value(t)
    if value is None and t.op.type == "ShapeN":
        source = t.op.inputs[t.value_index]
        if source.shape.is_fully_defined():
            value = np.array(source.shape.as_list(), t.dtype.as_numpy_dtype)
    return None if value is None else np.asarray(value)


def _build_kernel(sig, rng, device):
    """The kernel of ``kernel_signature`` ``sig`` alone on ``device``, in the current
    graph, its float inputs random variables: its op."""
    _, kind, blob, inputs = json.loads(sig)
    node = v1.NodeDef.FromString(base64.b64decode(blob))
    node.name, node.device = "kernel", device
    graph_def, feeds = v1.GraphDef(), {}
    with v1.device(device):
        for i, (dtype, dims, value) in enumerate(inputs):
            dtype = tf.as_dtype(dtype)
            if value is not None:
                x = tf.constant(value, dtype)
            elif dims is None:
                x = tf.zeros([0], dtype)
            elif dtype.is_floating:
                x = tf.cast(v1.Variable(rng.uniform(0.5, 1.5, dims).astype(np.float32),
                                        trainable=False), dtype)
            else:           # labels, indices: zeros are in range
                x = tf.zeros(dims, dtype)
            holder = graph_def.node.add()
            holder.name, holder.op = "in_%d" % i, "Placeholder"
            holder.attr["dtype"].type = dtype.as_datatype_enum
            node.input.append(holder.name)
            feeds[holder.name + ":0"] = x
    graph_def.node.extend([node])
    return v1.import_graph_def(graph_def, input_map=feeds, return_elements=["kernel"],
                               name="k")[0]


def _build(sig, rng):
    """The product of ``sig`` on random inputs in the current graph: its op."""
    kind, shapes, attrs = json.loads(sig)
    out_shape = shapes[-1]

    def var(shape):
        x = v1.Variable(rng.rand(*shape).astype(np.float32), trainable=False)
        return tf.cast(x, attrs["T"]) if "T" in attrs else x
    conv = dict(strides=attrs.get("strides"), padding=attrs.get("padding"),
                data_format=attrs.get("data_format", "NHWC"),
                dilations=attrs.get("dilations"))
    if kind == "MatMul":
        y = tf.linalg.matmul(var(shapes[0]), var(shapes[1]),
                             transpose_a=attrs.get("transpose_a", False),
                             transpose_b=attrs.get("transpose_b", False))
    elif kind.startswith("BatchMatMul"):
        y = tf.linalg.matmul(var(shapes[0]), var(shapes[1]),
                             adjoint_a=attrs.get("adj_x", False),
                             adjoint_b=attrs.get("adj_y", False))
    elif kind == "Conv2D":
        y = v1.nn.conv2d(var(shapes[0]), var(shapes[1]), **conv)
    elif kind == "Conv2DBackpropInput":
        y = v1.nn.conv2d_backprop_input(tf.constant(out_shape, tf.int32), var(shapes[1]),
                                        var(shapes[2]), **conv)
    else:
        y = v1.nn.conv2d_backprop_filter(var(shapes[0]), tf.constant(out_shape, tf.int32),
                                         var(shapes[2]), **conv)
    return y.op


KERNEL_BUDGET_S = 0.05   # seconds of runs per kernel (most are small; products: 0.2)
# A kernel run alone pays what a step does not: the executor's hand-off to its pool and
# the sleeping threads' wake-up (measured: ~60 us for a 16 x 16 product, whose work is
# ~1 us; half of a GPT step's kernels take less than 65 us alone).  This tiny product,
# timed like the others (longer), is that cost: ``in_step`` removes it.
ISOLATION = json.dumps(["MatMul", [[16, 16], [16, 16], [16, 16]],
                        {"transpose_a": False, "transpose_b": False}], sort_keys=True)


def in_step(timing, isolation):
    """A kernel's timing less the cost of running it alone (``ISOLATION``'s timing)."""
    return dict((k, max(0.0, timing[k] - isolation[k])) for k in ("alone", "shared"))


def _fast_seconds(sess, fetch, budget=0.2, least=5):
    """The median of the runs after a warm-up (other work on shared cores only slows
    runs down; the median keeps one lucky run out)."""
    sess.run(fetch)                                  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget
                                 and len(times) < max(50, int(budget * 250))):
        began = time.perf_counter()
        sess.run(fetch)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def measure(sigs, cores):
    """{sig: {"alone": s, "shared": s}} for the signatures, timed now."""
    out = {}
    rng = np.random.RandomState(0)
    for sig in sigs:
        kernel = sig.startswith('["kernel"')
        budget = KERNEL_BUDGET_S if kernel else 1.0 if sig == ISOLATION else 0.2
        graph = tf.Graph()
        with graph.as_default():
            if kernel:
                build = lambda device: _build_kernel(sig, rng, device)  # noqa: E731
            else:
                def build(device):
                    with v1.device(device):
                        return _build(sig, rng)
            try:
                alone = build("/device:CPU:0")
                copies = [build("/device:CPU:%d" % i) for i in range(cores)]
            except (ValueError, TypeError, tf.errors.OpError):
                if not kernel:
                    raise
                out[sig] = None                     # not rebuilt alone: the roofline's
                continue
            empty = tf.no_op()
            cfg = v1.ConfigProto(device_count={"CPU": cores})
            with v1.Session(graph=graph, config=cfg) as sess:
                try:
                    sess.run(v1.global_variables_initializer())
                    floor = _fast_seconds(sess, empty, budget)   # Session.run's own cost
                    out[sig] = {"alone": max(0.0, _fast_seconds(sess, alone, budget) - floor),
                                "shared": max(0.0, _fast_seconds(sess, copies, budget)
                                              - floor)}
                except tf.errors.OpError:
                    if not kernel:
                        raise
                    out[sig] = None
    return out


def cache_path():
    return os.path.splitext(local.cache_path())[0] + "-products.json"


def timed(sigs, cores, path=None):
    """The cached timings of ``sigs`` (the missing ones measured now and cached); a
    kernel that could not be timed alone maps to None."""
    path = path or cache_path()
    try:
        with open(path) as f:
            cached = json.load(f)
    except (IOError, OSError, ValueError):
        cached = {}
    missing = sorted(set(s for s in sigs if s not in cached))
    if missing:
        cached.update(measure(missing, cores))
        local.save_cache(cached, path)
    return dict((s, cached[s]) for s in sigs)
