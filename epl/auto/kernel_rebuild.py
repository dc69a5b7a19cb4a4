"""A step's kernel rebuilt alone, for ``product_timing`` to time in chains: its inputs
(random variables of its shapes, integer inputs their values or zeros; a max pool's
gradient reading the forward pool) and the op itself, imported from its NodeDef (a
product: rebuilt from its shapes and attributes).  The ops that make the inputs in each
run are collected (``PRELUDE``), so that a timing's empty run makes them too."""
import base64
import json

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def kernel_inputs(sig, rng, device, constants=False):
    """The inputs of ``kernel_signature`` ``sig`` on ``device``: {placeholder: tensor};
    float inputs random variables (``constants``: random constants, read in place with
    no op of their own to run: ``kernel_mix``), integer ones their values or zeros."""
    feeds = {}
    _, kind, blob, inputs = json.loads(sig)
    with v1.device(device):
        for i, (dtype, dims, value) in enumerate(inputs):
            dtype = tf.as_dtype(dtype)
            if value is not None:
                x = tf.constant(value, dtype)
            elif dims is None:
                x = tf.zeros([0], dtype)
            elif dtype.is_floating and constants:
                x = tf.constant(rng.uniform(0.5, 1.5, dims).astype(dtype.as_numpy_dtype))
            elif dtype.is_floating:     # (read once: a chain's copies share the read)
                x = tf.identity(tf.cast(v1.Variable(
                    rng.uniform(0.5, 1.5, dims).astype(np.float32), trainable=False), dtype))
                v1.add_to_collection(PRELUDE, x.op)     # (read, or cast, each run)
            elif constants:     # labels, indices: zeros are in range
                x = tf.constant(np.zeros(dims, dtype.as_numpy_dtype))
            else:
                x = tf.zeros(dims, dtype)
            feeds["in_%d:0" % i] = x
        if kind == "MaxPoolGrad" and not constants:
            feeds["in_1:0"] = _pooled(blob, feeds["in_0:0"])
    return feeds


# The ops that make a kernel's inputs in each run of its chain (not its copies'): a
# timing's empty run runs them too (``product_timing._time_one``), so that a lone run's
# cost beyond its chain (``first``: the wake-up) holds none of them.  Measured (TF 2.21,
# the Xeon with AMX): the conv net's bf16 kernels' inputs, cast from float32 each run,
# read as 0.5-0.9 ms wake-ups a kernel, 15 ms a replica's step, and priced its DP 2 +
# AMP step at 34.8 ms against 22.9 measured (its kernels' work alone: 21.9).
PRELUDE = "epl_kernel_prelude"
# A max pool's gradient runs oneDNN's kernel (TensorFlow 2.x on Intel CPUs) only where
# its second input is the forward max pool's output, whose workspace it reads
# (mkl_layout_pass: MaxPoolGrad is rewritten only then); fed any other tensor it runs
# Eigen's.  Measured (the conv net, TF 2.21, the Xeon with AMX): its two MaxPoolGrads
# took 4.6 + 2.2 ms in chains on fed inputs, 1.2 ms together in the step (the conv net's
# rows read +9 ... +26 % for it).  So a chain's copies read a max pool of the first
# input, made once a run (``PRELUDE``).


def _pooled(blob, x):
    """The forward max pool of ``x`` by the attributes of a MaxPoolGrad's NodeDef
    (``blob``: base64, as a kernel signature holds it)."""
    node = v1.NodeDef.FromString(base64.b64decode(blob))
    attr = node.attr
    fmt = attr["data_format"].s.decode() if "data_format" in attr else "NHWC"
    y = v1.nn.max_pool(x, list(attr["ksize"].list.i), list(attr["strides"].list.i),
                       attr["padding"].s.decode(), data_format=fmt)
    v1.add_to_collection(PRELUDE, y.op)
    return y


def import_kernel(sig, feeds, device):
    """The kernel of ``sig`` on ``device`` reading ``feeds``: its op."""
    _, _, blob, inputs = json.loads(sig)
    node = v1.NodeDef.FromString(base64.b64decode(blob))
    node.name, node.device = "kernel", device
    graph_def = v1.GraphDef()
    for i, (dtype, _, _) in enumerate(inputs):
        holder = graph_def.node.add()
        holder.name, holder.op = "in_%d" % i, "Placeholder"
        holder.attr["dtype"].type = tf.as_dtype(dtype).as_datatype_enum
        node.input.append(holder.name)
    graph_def.node.extend([node])
    return v1.import_graph_def(graph_def, input_map=feeds, return_elements=["kernel"],
                               name="k")[0]


def build_kernel(sig, rng, device):
    """The kernel of ``kernel_signature`` ``sig`` alone on ``device``, in the current
    graph, its float inputs random variables: its op."""
    return import_kernel(sig, kernel_inputs(sig, rng, device), device)


def product_inputs(sig, rng):
    """The product's operands: random variables of its shapes (in its dtype); None
    where the product takes a shape."""
    kind, shapes, attrs = json.loads(sig)

    def var(shape):     # (read once: a chain's copies share the read)
        x = v1.Variable(rng.rand(*shape).astype(np.float32), trainable=False)
        x = tf.identity(tf.cast(x, attrs["T"]) if "T" in attrs else x)
        v1.add_to_collection(PRELUDE, x.op)     # (read, or cast, each run)
        return x
    if kind == "Conv2DBackpropInput":
        return [None, var(shapes[1]), var(shapes[2])]
    if kind == "Conv2DBackpropFilter":
        return [var(shapes[0]), None, var(shapes[2])]
    return [var(shapes[0]), var(shapes[1])]


def product(sig, inputs):
    """The product of ``sig`` on ``inputs`` (``product_inputs``), in the current
    graph: its op."""
    kind, shapes, attrs = json.loads(sig)
    out_shape = shapes[-1]
    conv = dict(strides=attrs.get("strides"), padding=attrs.get("padding"),
                data_format=attrs.get("data_format", "NHWC"),
                dilations=attrs.get("dilations"))
    if kind == "MatMul":
        y = tf.linalg.matmul(inputs[0], inputs[1],
                             transpose_a=attrs.get("transpose_a", False),
                             transpose_b=attrs.get("transpose_b", False))
    elif kind.startswith("BatchMatMul"):
        y = tf.linalg.matmul(inputs[0], inputs[1], adjoint_a=attrs.get("adj_x", False),
                             adjoint_b=attrs.get("adj_y", False))
    elif kind == "Conv2D":
        y = v1.nn.conv2d(inputs[0], inputs[1], **conv)
    elif kind == "Conv2DBackpropInput":
        y = v1.nn.conv2d_backprop_input(tf.constant(out_shape, tf.int32), inputs[1],
                                        inputs[2], **conv)
    else:
        y = v1.nn.conv2d_backprop_filter(inputs[0], tf.constant(out_shape, tf.int32),
                                         inputs[2], **conv)
    return y.op


def build(sig, rng):
    """The product of ``sig`` on random inputs in the current graph: its op."""
    return product(sig, product_inputs(sig, rng))
