"""What a cheap kernel costs in a step beyond its chain: the kernels before it differ.

``product_timing`` times a kernel in a chain of copies of itself: its code, its
branches and its inputs stay in the core's caches from one copy to the next.  A step
runs each kernel after different ones.  For a kernel of a few microseconds that
difference is a share of its time the chain never sees (measured, AMD EPYC, TF 1.15:
the corpus mini-BERT's 766 cheap kernels took 0.84-0.93 ms one after another in the
order of its step, their chains summed 0.69 ms; twelve different elementwise kernels
on 24 x 24 floats took 0.55 us each in turn, 0.30-0.35 us each in chains of their own;
stop 60).  An executor-bound step (the mini-BERT's: 1290 ops of 1-3 us) was priced
16 % fast for it; 4 % with it, on the same measurements.

The probe is the step's own cheap kernels (``sequence``: those its timings put under
``dataflow.INLINE_S``, which run on one thread), each once, in the step's order, each
after the one before (a control edge), on constant inputs; less a run of the constants
alone.  Its seconds per kernel are cached with the kernels' timings (``signature``: a
digest of the sequence) and taken at their fastest across rounds like them
(``product_timing.least``).  ``excess`` is what each cheap kernel adds beyond its own
chain: ``local_step.replay`` adds it to every cheap kernel of every layout of the
model."""
import hashlib
import json

import numpy as np
import tensorflow as tf

from epl.auto import dataflow, local, product_timing, shapes
from epl.core import host_heap

v1 = tf.compat.v1

_MOST = 2000                # kernels in the probe's chain at most
_MOST_BYTES = 64 << 20      # bytes of constant inputs at most (a cheap kernel's are few)
_BUDGET_S = 0.5             # seconds of runs per fetch


def is_cheap(sig, timing):
    """Whether a kernel of signature ``sig`` timed ``timing`` is one the probe stands
    for: a kernel (not a product) under ``dataflow.INLINE_S`` alone, on one thread."""
    return bool(timing) and sig.startswith('["kernel"') \
        and timing["alone"] < dataflow.INLINE_S


def sequence(flow, timings):
    """The step's cheap kernels (``is_cheap``) in the step's order: the kernel
    signatures of ``flow`` (``step_graph.dataflow``), the optimizer's updates left out
    (``update_timing`` times them cold), at most ``_MOST``."""
    updates = set(i for i, _ in flow.get("updates") or ())
    out = [sig for i, sig in enumerate(flow["sigs"])
           if sig is not None and i not in updates and is_cheap(sig, timings.get(sig))]
    return out[:_MOST]


def signature(seq):
    """The cache key of the probe of ``seq``."""
    digest = hashlib.sha1(json.dumps(seq).encode("utf-8")).hexdigest()[:20]
    return json.dumps(["executor", "mix", digest, len(seq)])


def _input_bytes(sig):
    return sum(tf.as_dtype(dtype).size * shapes.elements(dims)
               for dtype, dims, value in json.loads(sig)[3] if value is None and dims)


def measure(seq, cores):
    """{"alone": seconds per kernel of ``seq`` run one after another (the constants'
    own run taken off), "shared": the same, "first": 0, "first_shared": 0, "kernels":
    how many of ``seq``'s first kernels the probe ran (``_MOST_BYTES``)}, or None where
    fewer than two or one cannot be rebuilt."""
    host_heap.keep_freed_memory()
    kept, nbytes = [], 0
    for sig in seq:
        nbytes += _input_bytes(sig)
        if nbytes > _MOST_BYTES:
            break
        kept.append(sig)
    if len(kept) < 2:
        return None
    rng = np.random.RandomState(0)
    device = "/device:CPU:0"
    graph = tf.Graph()
    with graph.as_default():
        held, chain = [], []
        try:
            for sig in kept:
                feeds = product_timing.kernel_inputs(sig, rng, device, constants=True)
                held.extend(t.op for t in feeds.values())
                with v1.control_dependencies(chain[-1:]):
                    chain.append(product_timing.import_kernel(sig, feeds, device))
        except (ValueError, TypeError, tf.errors.OpError):
            return None
        with v1.device(device):
            floor = tf.group(*held)
        with v1.Session(graph=graph, config=product_timing.session_config(cores)) as sess:
            try:
                whole, alone = product_timing.medians(sess, [chain[-1], floor], _BUDGET_S)
            except tf.errors.OpError:
                return None
    per = max(0.0, whole - alone) / len(kept)
    return {"alone": per, "shared": per, "first": 0.0, "first_shared": 0.0,
            "kernels": len(kept)}


def timed(seq, cores, path=None):
    """The probe of ``seq`` from the kernels' cache (measured now and cached where it
    is missing), or None where there is none."""
    if len(seq) < 2:
        return None
    path = path or product_timing.cache_path()
    sig = signature(seq)
    cached = product_timing.cached_timings(path)
    if sig not in cached:
        cached[sig] = measure(seq, cores)
        local.save_cache(cached, path)
    return cached[sig]


def excess(seq, timings, probe):
    """Seconds each cheap kernel adds to a step beyond its chain: the probe's seconds
    per kernel less the mean of the kernels' chain times (0 where it is not above it or
    there is no probe)."""
    if not probe or not seq:
        return 0.0
    chains = [timings[s]["alone"] for s in seq[:int(probe.get("kernels", len(seq)))]
              if timings.get(s)]
    if not chains:
        return 0.0
    return max(0.0, probe["alone"] - sum(chains) / len(chains))
