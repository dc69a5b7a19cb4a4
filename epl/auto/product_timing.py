"""A model's own matrix products and convolutions, timed one by one on this machine.

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

Results are cached beside the calibration (``<cache>-products.json``), keyed by the
product's signature, so a model is timed once per machine.  A product that cannot be
built alone (an einsum, explicit padding) is left to the FLOP model.
"""
import json
import os
import time

import numpy as np
import tensorflow as tf

from epl.auto import local

v1 = tf.compat.v1
PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropInput",
            "Conv2DBackpropFilter")
_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "strides", "padding",
          "data_format", "dilations")


def signature(op, rows):
    """A JSON-able key of a product op at ``rows`` rows, or None when it is not one
    we can time (unknown shapes, explicit padding, not float32)."""
    if op.type not in PRODUCTS or op.outputs[0].dtype != tf.float32:
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
    return json.dumps([op.type, shapes, attrs], sort_keys=True)


def _build(sig, rng):
    """The product of ``sig`` on random inputs in the current graph: its op."""
    kind, shapes, attrs = json.loads(sig)
    out_shape = shapes[-1]

    def var(shape):
        return v1.Variable(rng.rand(*shape).astype(np.float32), trainable=False)
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


def _fast_seconds(sess, fetch, budget=0.2, least=5):
    """A low percentile (the 20th) of the runs after a warm-up: other work on shared
    cores only slows runs down."""
    sess.run(fetch)                                  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget and len(times) < 50):
        began = time.perf_counter()
        sess.run(fetch)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def measure(sigs, cores):
    """{sig: {"alone": s, "shared": s}} for the signatures, timed now."""
    out = {}
    rng = np.random.RandomState(0)
    for sig in sigs:
        graph = tf.Graph()
        with graph.as_default():
            with v1.device("/device:CPU:0"):
                alone = _build(sig, rng)
            copies = []
            for i in range(cores):
                with v1.device("/device:CPU:%d" % i):
                    copies.append(_build(sig, rng))
            empty = tf.no_op()
            cfg = v1.ConfigProto(device_count={"CPU": cores})
            with v1.Session(graph=graph, config=cfg) as sess:
                sess.run(v1.global_variables_initializer())
                floor = _fast_seconds(sess, empty)     # Session.run's own cost
                out[sig] = {"alone": max(0.0, _fast_seconds(sess, alone) - floor),
                            "shared": max(0.0, _fast_seconds(sess, copies) - floor)}
    return out


def cache_path():
    return os.path.splitext(local.cache_path())[0] + "-products.json"


def timed(sigs, cores, path=None):
    """The cached timings of ``sigs`` (the missing ones measured now and cached)."""
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
