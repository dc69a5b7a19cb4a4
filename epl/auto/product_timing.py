"""A model's own kernels (matrix products, convolutions and the other ops a step runs),
timed one by one on this machine.

FLOPs over a peak miss by 2-3x on EPL's CPU devices: a model's products are thin (64
rows), batched (attention's 128 x 64 matrices) or convolutions whose gradient kernels
unfold patches, and how well one of them spreads over the cores depends on its shape
(measured: a lone device ran the GPT decoder 2.4x slower per row than two devices
running one replica each).  So ``Cluster.local`` prices the products of a model the way
Proteus and DistSim price ops: each distinct one (type, shapes, attributes; forward and
gradient kernels alike, read from the built graph by ``graph_profile``) is built alone
with random inputs and timed in a chain of copies, each waiting for the one before (a
step runs kernel after kernel; a kernel run alone also pays the executor's hand-off to
its threads, up to twice its own time on a small tensor): what one more copy adds,

* ``alone``: one device with the machine's cores to itself;
* ``shared``: as many devices as cores, each running a chain at once (the per-device
  time when every device is busy; more devices than cores take turns).

The other kernels of a step (batch norm and its gradient, pooling, ReLU gradients,
padding, the loss...: on a conv net a third of the step, where a bytes-over-bandwidth
roofline missed it by 30 %) are timed the same way (``kernel_signature``): the op's own
NodeDef is imported alone, its float inputs random variables of their static shapes,
its integer inputs their static values (shapes, axes, paddings) or zeros (labels,
indices).  What cannot be rebuilt (unknown shapes, state, control flow, functions) is
left to the roofline.

Results are cached beside the calibration (``<cache>-kernels-v3.json``), keyed by the
kernel's signature, so a model is timed once per machine.  A product that cannot be
built alone (an einsum, explicit padding) is left to the FLOP model; a kernel that
fails to run alone is cached as untimed (None).
"""
import json
import os
import time

import numpy as np
import tensorflow as tf

from epl.auto import cold_reads, local, update_timing
from epl.auto.kernel_rebuild import (  # noqa: F401 (kernel_mix, tests)
    PRELUDE, build as _build, build_kernel as _build_kernel, import_kernel,
    kernel_inputs, product as _product, product_inputs as _product_inputs)
from epl.core import host_heap

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
            or any(arg.is_ref for arg in op.op_def.input_arg) \
            or not op.outputs or not op.outputs[0].dtype.is_floating:
        return None             # (an input the kernel writes: an update, update_timing)
    if any(v.HasField("func") or len(v.list.func) for v in op.node_def.attr.values()):
        return None
    inputs = []
    for t in op.inputs:
        # a variable read in place (a ref: Grappler's casts moved next to the weights,
        # AMP) is its value to the kernel
        dtype = t.dtype.base_dtype
        if dtype in (tf.resource, tf.variant):
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
    return json.dumps(["kernel", op.type, update_timing.node_blob(op), inputs])


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


KERNEL_BUDGET_S = 0.05   # seconds of runs per kernel (most are small; products: 0.2)
# A kernel run alone pays what a step does not: the executor's hand-off to its pool and
# the sleeping threads' wake-up (measured: ~60 us for a 16 x 16 product whose work is
# ~1 us, ~120 us for a transpose that wakes two threads).  A step runs kernel after
# kernel without them, so each kernel is timed in a chain: CHAIN copies on the same
# inputs, each waiting for the one before (a control edge); its time in a step is what
# one more copy adds to the chain (the first copy carries the hand-off).
CHAIN = 17
CHAIN_S = 0.02           # a long kernel's chain is cut to about this many seconds
# A kernel that spreads over the cores wakes Eigen's sleeping threads when it starts
# with none of them busy, as one run alone does and a chain does not (measured: a
# transpose's lone run took 120 us, the chain 4 us a copy; the GPT's and the ResNet's
# lone-device steps took 62 us a multi-threaded kernel more than its chain times): the
# lone run's time (``first``) less the chain's and less what a one-thread product's lone
# run costs beyond its chain (the executor's hand-off: ``HANDOFF``) is that wake-up.
HANDOFF = json.dumps(["MatMul", [[16, 16], [16, 16], [16, 16]],
                      {"transpose_a": False, "transpose_b": False}], sort_keys=True)
# The executor's own work per op, which the ops without a kernel to time pay (views,
# variables, constants, state updates): a chain of identities, timed the same way, but
# EXECUTOR_CHAIN long: 17 identities of 0.05-0.1 us each read 0 in one timing and
# 0.1 us in another (stop 60; a chain of 800 read 0.05-0.1 us an identity).
EXECUTOR = json.dumps(["executor", "Identity"])
EXECUTOR_CHAIN = 513


# What a tensor crossing from one virtual device to another adds (TensorFlow's send
# and receive pair through the in-process rendezvous; measured 2-5 us): a chain whose
# copies alternate between two devices, less the same chain on one.
HOP = json.dumps(["executor", "hop"])


def _hop_seconds(budget):
    """{"alone": seconds a device crossing adds to an op, ...} (``HOP``)."""
    graph = tf.Graph()
    with graph.as_default():
        chains = []
        for devices in (("/device:CPU:0",) * 2, ("/device:CPU:0", "/device:CPU:1")):
            with v1.device(devices[0]):
                y = v1.Variable(np.ones([64, 64], np.float32))
            ops = []
            for i in range(CHAIN):
                with v1.device(devices[i % 2]):
                    y = y * 1.0001
                ops.append(y.op)
            chains.append([ops])
        with v1.Session(graph=graph, config=session_config(2)) as sess:
            sess.run(v1.global_variables_initializer())
            same, hop = [_per_copy(sess, c, budget)[0] for c in chains]
    return {"alone": max(0.0, hop - same), "shared": max(0.0, hop - same), "first": 0.0,
            "first_shared": 0.0}


def _chain(sig, rng, device, cores=1):
    """CHAIN copies (``EXECUTOR``: EXECUTOR_CHAIN) of the kernel (or product) of ``sig``
    on ``device``, each after the one before, on one set of inputs (an update: on sets
    of variables taken in turn, ``update_timing.chain``; ``cores`` chains at once): the
    ops, in order."""
    with v1.device(device):
        if sig == EXECUTOR:
            x = tf.constant([1.0])
            make = lambda: tf.identity(x).op                    # noqa: E731
        elif sig.startswith('["update"'):
            # (the chains on every core share the caches: their state together cold)
            return update_timing.chain(sig, rng, device, CHAIN, update_timing.sets_for(
                sig, CHAIN, update_timing.COLD_BYTES // cores))
        elif sig.startswith('["kernel"'):
            feeds = kernel_inputs(sig, rng, device)
            make = lambda: import_kernel(sig, feeds, device)   # noqa: E731
        else:
            operands = _product_inputs(sig, rng)
            make = lambda: _product(sig, operands)              # noqa: E731
        ops = [make()]
        for _ in range((EXECUTOR_CHAIN if sig == EXECUTOR else CHAIN) - 1):
            with v1.control_dependencies([ops[-1]]):
                ops.append(make())
    return ops


def session_config(cores):
    """``cores`` CPU devices, Grappler off: the chains run as built (its deduplication
    would merge the copies; a step's graph is optimized before it is profiled)."""
    cfg = v1.ConfigProto(device_count={"CPU": cores})
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    return cfg


def _fast_seconds(sess, fetch, budget=0.2, least=5):
    """The median of the runs after a warm-up (other work on shared cores only slows
    runs down; the median keeps one lucky run out)."""
    return medians(sess, [fetch], budget, least)[0]


BLOCKS = 4      # blocks of runs each fetch's runs are spread over (``medians``)


def medians(sess, fetches, budget=0.2, least=5):
    """Each fetch's median seconds, about ``budget`` seconds of runs each: the fetches
    take turns in BLOCKS blocks, a block a warm-up run then runs of one fetch back to
    back.  Spread over the whole timing, a slow moment of the machine (another process
    on the shared cores) falls on a share of every fetch's runs; timed one fetch after
    the other it fell on one (measured: a wide product's lone run read 6.21 ms and its
    chain 1.09 ms a copy in one run, 3.00 and 2.73 in another; its wake-up, the
    difference, priced the wide-head model 7-45 % slow).  Runs back to back, not one
    fetch after the other: a run that follows another fetch's starts colder (measured:
    the GPT's products' chains then read 5-16 % less a copy, and its steps 19 % fast)."""
    times = [[] for _ in fetches]
    cap = max(50, int(budget * 250)) // BLOCKS
    for _ in range(BLOCKS):
        for k, fetch in enumerate(fetches):
            sess.run(fetch)                          # warm-up
            start, block = time.perf_counter(), 0
            while block < -(-least // BLOCKS) or (
                    time.perf_counter() - start < budget / BLOCKS and block < cap):
                began = time.perf_counter()
                sess.run(fetch)
                times[k].append(time.perf_counter() - began)
                block += 1
    return [sorted(t)[len(t) // 2] for t in times]


def _per_copy(sess, chains, budget, floor=None):
    """(seconds one copy adds to ``chains`` run side by side, seconds of the run
    through their first copies less ``floor``'s run where given, ``floor``'s run or
    0): the runs through their first copy and through a later one (fewer copies for a
    long kernel), taken in turn with ``floor`` (``medians``)."""
    firsts = [c[0] for c in chains]
    sess.run(firsts)                                 # warm-up
    began = time.perf_counter()
    sess.run(firsts)
    rough = time.perf_counter() - began
    n = int(min(len(chains[0]), max(3, 1 + CHAIN_S / max(rough, 1e-6))))
    fetches = [firsts, [c[n - 1] for c in chains]] + ([floor] if floor is not None else [])
    times = medians(sess, fetches, budget)
    empty = times[2] if floor is not None else 0.0
    return max(0.0, (times[1] - times[0]) / (n - 1)), times[0] - empty, empty


HEAVY_S = 0.0005   # a kernel whose lone run reads this long is timed twice (``measure``)
# Timed on this shared machine, a wide kernel's times swing from run to run as the cores'
# neighbours and the shared cache come and go: the wide-head model's 512 x 8192 fp32
# product read 2.73, 1.09, 2.11 and 6.59 ms a copy in four runs' caches (its bf16 one
# 6.9, 5.3, 14.5 and 12.8 ms) while the model's measured steps held steady, and the
# run that read 6.59 priced its steps 25-30 % slow (the others: within 14 %).  Timed
# 40 times in a row it read 2.7-3.1 ms.  Other work only slows a run down, so such a
# kernel is timed once more after all the others, minutes later, and each of its times
# is the lesser of the two (the small kernels, most of the signatures, are many: their
# noise averages out over a step, and timing them twice would double the ~2 minutes).


def measure(sigs, cores):
    """{sig: {"alone": s, "shared": s, "first": s, "first_shared": s}} for the
    signatures, timed now: the seconds each adds to a step, ``alone`` on one device,
    ``shared`` with a copy on every core; ``first``: one run of it alone less an empty
    run; ``first_shared``: one run of a copy on every core at once less an empty run
    (what a kernel's wake-up is with another replica's beside it: recorded for the
    replay's wake-up rule, docs/plan.md, stop 52; caches without it still price).  A
    heavy kernel (``HEAVY_S``) is timed again at the end: the lesser of its two times
    is kept.  Timed with the heap as ``epl.init`` leaves it (``host_heap``)."""
    host_heap.keep_freed_memory()
    rng = np.random.RandomState(0)
    out = dict((sig, _time_one(sig, rng, cores)) for sig in sigs)
    for sig in sigs:
        once = out[sig]
        if sig not in (HOP, cold_reads.SIGNATURE) and once \
                and max(once["alone"], once["first"]) >= HEAVY_S:
            out[sig] = least(once, _time_one(sig, rng, cores))
    return out


def least(a, b):
    """Two timings of one kernel as one: each figure the lesser (other work on the
    shared cores only slows a run down); a timing that is None (the kernel could not run
    that time) gives way to the other."""
    if a is None or b is None:
        return b if a is None else a
    out = dict(b)
    out.update((k, min(v, b[k]) if k in b else v) for k, v in a.items())
    return out


def _time_one(sig, rng, cores):
    """``sig``'s timings (``measure``), or None for a kernel that could not be rebuilt
    or run alone (the roofline prices it)."""
    if sig == HOP:
        return _hop_seconds(KERNEL_BUDGET_S * 4)
    if sig == cold_reads.SIGNATURE:
        return cold_reads.measure()
    kernel = sig.startswith('["kernel"') or sig.startswith('["update"') \
        or sig == EXECUTOR
    budget = KERNEL_BUDGET_S if kernel else 0.2
    graph = tf.Graph()
    with graph.as_default():
        try:
            chains, mine = [], 0
            for i in range(cores):
                chains.append(_chain(sig, rng, "/device:CPU:%d" % i, cores))
                if i == 0:
                    mine = len(v1.get_collection(PRELUDE))
        except (ValueError, TypeError, tf.errors.OpError):
            if not kernel:
                raise
            return None
        # Session.run's own, and the inputs the first chain's runs make (``PRELUDE``)
        floor = tf.group(*v1.get_collection(PRELUDE)[:mine])
        with v1.Session(graph=graph, config=session_config(cores)) as sess:
            try:
                sess.run(v1.global_variables_initializer())
                sess.run(v1.get_collection(update_timing.INITS))
                alone, first, empty = _per_copy(sess, chains[:1], budget, floor)
                # (``first_shared`` is recorded, not priced: the other chains' inputs
                # are in it)
                shared, first_shared, _ = _per_copy(sess, chains, budget)
                return {"alone": alone, "shared": shared, "first": max(0.0, first),
                        "first_shared": max(0.0, first_shared - empty)}
            except tf.errors.OpError:
                if not kernel:
                    raise
                return None


def input_seconds(dataset_fn, budget=0.3):
    """Seconds the model's input pipeline takes to hand a step its batch: a
    ``get_next`` of ``dataset_fn()``'s iterator, less an empty run (measured: the
    corpus mini-BERT's slice-and-batch pipeline took ~0.14 ms a batch, a twentieth of
    its step, paid once per replica and per micro-batch clone).  The user's input,
    never the model, is run."""
    host_heap.keep_freed_memory()
    graph = tf.Graph()
    with graph.as_default():
        batch = v1.data.make_one_shot_iterator(dataset_fn()).get_next()
        pull = tf.group(*tf.nest.flatten(batch))
        empty = tf.no_op()
        with v1.Session(graph=graph) as sess:
            floor = _fast_seconds(sess, empty, budget)
            return max(0.0, _fast_seconds(sess, pull, budget) - floor)


def cache_path():
    # (``-products.json`` held the times of single runs, ``-kernels.json`` the chains
    # without ``first``, ``-kernels-v2.json`` max pool gradients on fed inputs: not read)
    return os.path.splitext(local.cache_path())[0] + "-kernels-v3.json"


def timed(sigs, cores, path=None):
    """The cached timings of ``sigs`` (the missing ones measured now and cached); a
    kernel that could not be timed alone maps to None."""
    path = path or cache_path()
    cached = cached_timings(path)
    missing = sorted(set(s for s in sigs if s not in cached))
    if missing:
        cached.update(measure(missing, cores))
        local.save_cache(cached, path)
    return dict((s, cached[s]) for s in sigs)


def cached_timings(path=None):
    """Every kernel's timings in the cache (``cache_path``), {} where there is none."""
    try:
        with open(path or cache_path()) as f:
            return json.load(f)
    except (IOError, OSError, ValueError):
        return {}
