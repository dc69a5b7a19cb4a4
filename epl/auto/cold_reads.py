"""Weights a step reads from memory, not from the cache: what a kernel's chain misses.

A kernel is timed in a chain on one set of inputs (``product_timing``), so its weight is
in the cache for every copy but the first.  In a step, a weight was last written by the
previous step's update.  Where the step's variables (weights and the optimizer's slots)
outgrow the last-level cache, the first kernel to read a weight fetches it from memory
(measured, AMD EPYC with 32 MiB of L3: the MLP's fused 1024 x 1024 layer took 0.42 ms a
copy in a chain on one weight, 0.68 ms on weights taken in turn from 96 MiB, and
0.60-0.68 ms in its step, whose state is ~60 MiB; stop 59).

``SIGNATURE`` is timed with the kernels and cached beside them (``product_timing``):
{"alone": seconds per byte of a weight read cold, "cache": the last-level cache's bytes}.
``step_graph.dataflow`` gives each op the bytes it is the first in the step to read of a
variable (``first_reads``) and the step's variables' bytes; ``local_step.replay`` adds
those reads at that rate where the variables outgrow the cache, shared by the replicas
of one process (they read one copy of the variables).  Priced on every read instead,
the MLP's pipelines read +18-26 % (its micro-batches read each weight 4-8 times).

The same holds for the activations a step reads long after it wrote them (the backward
pass reading what the forward pass saved): ``cold_activations`` gives each op those
bytes by reuse distance, priced at the same rate."""
import json
import os
import time

import tensorflow as tf

from epl.auto import liveness, shapes
from epl.core import host_heap

v1 = tf.compat.v1

SIGNATURE = json.dumps(["executor", "cold read"])
_VARIABLES = ("VariableV2", "Variable", "VarHandleOp")
_READS = ("Identity", "ReadVariableOp", "Snapshot")
_WIDTH = 1024           # the probe's layer: a [64, 1024] batch through 1024 x 1024 weights
_LAYERS = 24            # at least this many layers in the probe's chain
_MOST = 256             # at most this many (1 GiB of weights: a larger cache stays warm)


def cache_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """The last-level cache's bytes (Linux's sysfs), or None where it is not shown."""
    best = None
    try:
        for entry in os.listdir(root):
            if not entry.startswith("index"):
                continue
            path = os.path.join(root, entry)
            with open(os.path.join(path, "level")) as f:
                level = int(f.read())
            with open(os.path.join(path, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            nbytes = int(size.rstrip("KMG")) * scale
            if best is None or level > best[0]:
                best = (level, nbytes)
    except (OSError, ValueError):
        return None
    return best[1] if best else None


def first_reads(ops):
    """The bytes each of ``ops`` (a step's, in the order they run) is the first to read
    of a variable's value (the variable itself, or an identity or read of it): a step
    reads each weight from memory once; its other readers (the backward pass, the next
    micro-batch, another replica in the process) find it in the cache."""
    seen, out = set(), []
    for op in ops:
        n = 0
        for t in ([] if _not_a_reader(op) else op.inputs):
            source = t.op.inputs[0].op if t.op.type in _READS and t.op.inputs else t.op
            if source.type in _VARIABLES and source.name not in seen \
                    and t.shape.is_fully_defined():
                seen.add(source.name)
                n += shapes.elements(t.shape.as_list()) * t.dtype.base_dtype.size
        out.append(n)
    return out


def cold_activations(ops, cache, rows):
    """The bytes each of ``ops`` (a step's, in the order they run) reads of a tensor
    that is not a variable's value and was last touched ``cache`` bytes of traffic or
    more before (the outputs written since, and the cold inputs read): such a tensor
    has left the last-level cache, and its chain, timed on one set of inputs, did not
    pay for fetching it.  Where it is read again soon after, the next readers find it
    in the cache.  Measured (AMD EPYC, 32 MiB of L3): the GPT decoder's step reads 212
    MiB of its activations so, mostly the backward pass reading what the forward pass
    saved, 15 ms at the probe's rate against a one-device step predicted 19-30 ms fast;
    the MLP, the wide head and the mini-BERT read none.  ``cache`` None (not known):
    none; a tensor's bytes at ``rows`` rows (``liveness.tensor_bytes``)."""
    if not cache:
        return [0] * len(ops)
    traffic, touched, out = 0, {}, []
    for op in ops:
        n = 0
        for t in ([] if _not_a_reader(op) else op.inputs):
            source = t.op.inputs[0].op if t.op.type in _READS and t.op.inputs else t.op
            if source.type in _VARIABLES:
                continue
            if t in touched and traffic - touched[t] >= cache:
                size = liveness.tensor_bytes(t, rows)
                n += size
                traffic += size
            touched[t] = traffic
        for t in op.outputs:
            traffic += liveness.tensor_bytes(t, rows)
            touched[t] = traffic
        out.append(n)
    return out


def per_activation_byte(timing):
    """Seconds a byte of ``cold_activations`` adds in a step: the cold rate (the cache's
    size is in the distances already), or none where it was not timed."""
    if not timing or not timing.get("cache"):
        return 0.0
    return max(0.0, timing.get("alone", 0.0))


def _not_a_reader(op):
    """A view of a variable (its read), or an op that writes one (an update, timed
    cold by ``update_timing``; an initializer)."""
    return op.type in _READS or op.op_def.is_stateful \
        or any(arg.is_ref for arg in op.op_def.input_arg)


def state_bytes(ops):
    """The bytes of the variables among ``ops`` (weights and the optimizer's slots)."""
    total = 0
    for op in ops:
        if op.type in _VARIABLES:
            shape = tf.TensorShape(op.get_attr("shape"))
            dtype = tf.as_dtype(op.get_attr("dtype")).base_dtype
            if shape.is_fully_defined():
                total += shapes.elements(shape.as_list()) * dtype.size
    return total


def per_byte(timing, state):
    """Seconds a byte read from a variable adds in a step whose variables hold ``state``
    bytes: the cold rate where they outgrow the cache, else none (``timing``:
    ``SIGNATURE``'s, or None where it was not timed)."""
    if not timing or not timing.get("cache") or state <= timing["cache"]:
        return 0.0
    return max(0.0, timing.get("alone", 0.0))


def measure(budget=0.4):
    """``SIGNATURE``'s timing: a chain of fused layers, each on its own weight, three
    times the cache's bytes of them in all (cold: each run reads every weight from
    memory), against the same chain on one weight (hot), the difference per byte of
    weight; None where the cache's size is not known."""
    host_heap.keep_freed_memory()
    cache = cache_bytes()
    if not cache:
        return None
    weight = _WIDTH * _WIDTH * 4
    layers = int(min(_MOST, max(_LAYERS, -(-3 * cache // weight))))
    seconds = []
    for count in (1, layers):
        graph = tf.Graph()
        with graph.as_default():
            h = v1.Variable(tf.random.uniform([64, _WIDTH], 0.0, 1.0, seed=1))
            ws = [v1.Variable(tf.random.uniform([_WIDTH, _WIDTH], 0.0, 1e-3, seed=i))
                  for i in range(count)]
            b = v1.Variable(tf.zeros([_WIDTH]))
            out = h
            for i in range(layers):
                out = tf.nn.relu(tf.nn.bias_add(tf.matmul(out, ws[i % count]), b))
            fetch = tf.reduce_sum(out)
            with v1.Session(graph=graph) as sess:
                sess.run(v1.global_variables_initializer())
                for _ in range(3):
                    sess.run(fetch)
                runs, start = [], time.perf_counter()
                while len(runs) < 5 or time.perf_counter() - start < budget / 2:
                    began = time.perf_counter()
                    sess.run(fetch)
                    runs.append(time.perf_counter() - began)
                seconds.append(sorted(runs)[len(runs) // 2])
    rate = max(0.0, (seconds[1] - seconds[0]) / (layers * weight))
    return {"alone": rate, "shared": rate, "first": 0.0, "first_shared": 0.0,
            "cache": cache}
