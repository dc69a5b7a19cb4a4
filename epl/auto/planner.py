"""``epl.auto.plan``: every layout EPL can run on a cluster, priced by ``predict`` from
one build of the model's graph, those over the device memory dropped, the rest ranked by
predicted samples/s (where the cluster says predictions closer than a share are ties:
the simplest of the tied first, ``rank``).

Enumerated: tensor-parallel degree t (divides the heads and the devices per node) x
pipeline stages p (divides the blocks) x data parallelism d = devices / (t p) (divides
the global batch) x micro-batch size (EPL's runtime: the dataset's batch) x
recomputation x ZeRO (x offload, x schedules when asked).
"""
import json
import time

from epl.auto import graph_profile
from epl.auto.layout import Layout
from epl.auto.predictor import price

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _smallest_factor(n):
    for k in range(2, n + 1):
        if n % k == 0:
            return k
    return 1


class Candidate(object):
    """A ranked layout: ``strategy`` (the list ``accelerate(load_strategy=...)``
    reads), ``config`` (EPL config keys), ``prediction``, and ``requires``: what the
    user's program must do that no config key does (``rows``: the dataset's batch)."""

    def __init__(self, layout, prediction, devices_per_node, rows=None):
        self.layout = layout
        self.prediction = prediction
        self.strategy = prediction.layout.to_strategy()
        self.config = prediction.layout.to_config(devices_per_node)
        lay = prediction.layout
        self.requires = []
        if lay.t > 1:
            self.requires.append("the model's blocks built under epl.split(%d) "
                                 "(docs/split.md): EPL does not split a model itself" % lay.t)
        if rows and lay.micro_batch_size and lay.micro_batch_size != rows:
            self.requires.append("the dataset batched by %d rows, not %d: each of EPL's "
                                 "micro-batches is one batch of it"
                                 % (lay.micro_batch_size, rows))

    def to_dict(self):
        pred = self.prediction.to_dict()
        pred["breakdown"] = {k: v for k, v in pred["breakdown"].items() if k != "stages"}
        return dict(strategy=self.strategy, config=self.config, prediction=pred,
                    requires=self.requires)


class PlanReport(object):
    """``candidates`` (feasible, fastest first: ``rank``), ``infeasible`` (over memory),
    ``best``, ``seconds``, ``to_json(path)``, ``table()``."""

    def __init__(self, cluster, global_batch, candidates, infeasible, seconds, profile):
        self.cluster = cluster
        self.global_batch = global_batch
        self.candidates = candidates
        self.infeasible = infeasible
        self.seconds = seconds
        self.profile = profile

    @property
    def best(self):
        return self.candidates[0] if self.candidates else None

    def to_dict(self, limit=None):
        return dict(cluster=self.cluster.to_dict(), global_batch=self.global_batch,
                    seconds=self.seconds, params=self.profile.params(),
                    layers=self.profile.layers,
                    infeasible=len(self.infeasible),
                    candidates=[c.to_dict() for c in self.candidates[:limit]])

    def to_json(self, path=None, limit=None):
        text = json.dumps(self.to_dict(limit), indent=1, sort_keys=True, default=str)
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def table(self, top=10):
        head = "%-4s %-44s %10s %12s %8s %9s %10s" % (
            "rank", "layout", "step_s", "samples/s", "MFU", "TFLOP/s", "peak_GiB")
        lines = [head]
        for i, c in enumerate(self.candidates[:top]):
            p = c.prediction
            lines.append("%-4d %-44s %10.4g %12.4g %8.3f %9.1f %10.2f" % (
                i + 1, p.layout.describe(), p.step_time_s, p.samples_per_s, p.mfu,
                p.tflops_per_gpu, p.peak_memory_bytes / 2.0 ** 30))
        lines.append("%d feasible, %d over %.0f GiB, planned in %.1f s" % (
            len(self.candidates), len(self.infeasible),
            self.cluster.device.memory / 2.0 ** 30, self.seconds))
        return "\n".join(lines)


def layouts(profile, cluster, global_batch, dtype="fp32", recompute=(False, True),
            zero=(None, "v1"), offload=(False,), schedules=("1f1b",),
            micro_batch_sizes=None, chunks=None):
    """The layouts ``plan`` prices (``chunks`` of the interleaved schedule: by default
    the smallest factor > 1 of the blocks per stage).  ``micro_batch_sizes``: by default
    ``MICRO_BATCH_SIZES``, and on a cluster that runs EPL's own runtime (its stage cut:
    ``Cluster.local``) the dataset's batch alone: each of EPL's micro-batches pulls one
    batch from the dataset, and the model's kernels are timed at its rows (at another
    size a kernel's fixed costs would be scaled with its rows)."""
    if micro_batch_sizes is None:
        micro_batch_sizes = (profile.rows,) if cluster.stage_cut == "epl" and profile.rows \
            else MICRO_BATCH_SIZES
    n = cluster.num_devices
    heads = profile.heads
    out = []
    for t in _divisors(min(n, cluster.devices_per_node)):
        if heads and heads % t:
            continue
        if t > 1 and not any(b.flops_split for b in profile.blocks):
            continue
        for p in _divisors(profile.layers):
            if n % (t * p):
                continue
            d = n // (t * p)
            if global_batch % d:
                continue
            per = global_batch // d
            for mb in micro_batch_sizes:
                if per % mb or (p > 1 and per // mb < p):
                    continue
                for sched in (schedules if p > 1 else ("1f1b",)):
                    v = chunks or _smallest_factor(profile.layers // p)
                    if sched == "interleaved" and (v < 2 or (profile.layers // p) % v):
                        continue
                    for gc in recompute:
                        for z in (zero if d > 1 else (None,)):
                            for off in offload:
                                out.append(Layout(t=t, p=p, d=d, micro_batch_size=mb,
                                                  schedule=sched, chunks=v,
                                                  recompute=gc, zero=z, offload=off,
                                                  dtype=dtype))
    return out


def plan(model_fn, dataset_fn, optimizer_fn, cluster, global_batch, layers=None,
         amp=None, profile=None, memory_limit_bytes=None, split_variants=None,
         **options):
    """Rank the layouts of the model on ``cluster`` for ``global_batch`` rows per step.

    ``amp``: None (fp32), "float16" or "bfloat16".  ``layers``: the model's number of
    blocks when ``model_fn`` builds fewer (they are repeated).  ``profile``: reuse a
    ``graph_profile.profile``.  ``split_variants``: as ``predict``'s (the model built
    with its own ``epl.split(t)`` scopes, by t).  ``options``: ``recompute``, ``zero``,
    ``offload``, ``schedules``, ``micro_batch_sizes`` (tuples of the values to try)."""
    start = time.time()
    prof = profile or graph_profile.profile(model_fn, dataset_fn, optimizer_fn)
    if layers:
        prof = prof.repeated(layers)
    prof.split_variants = dict(split_variants or prof.split_variants)
    dtype = {None: "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(amp, amp)
    limit = memory_limit_bytes or cluster.device.memory
    feasible, infeasible = [], []
    for lay in layouts(prof, cluster, global_batch, dtype=dtype, **options):
        try:
            pred = price(prof, lay, cluster, global_batch)
        except ValueError:          # more stages than EPL's automatic cut can make
            continue
        cand = Candidate(lay, pred, cluster.devices_per_node, prof.rows)
        (feasible if pred.peak_memory_bytes <= limit else infeasible).append(cand)
    feasible = rank(feasible, lambda c: c.prediction.samples_per_s,
                    lambda c: (c.layout.p, c.layout.t), cluster.tie,
                    lambda c: c.prediction.peak_memory_bytes)
    return PlanReport(cluster, global_batch, feasible, infeasible, time.time() - start, prof)


def rank(items, rate, simplicity, tie=0.0, cost=lambda item: 0):
    """``items`` fastest first by predicted ``rate`` (then lowest ``cost``), except
    that the first is the simplest (lowest ``simplicity``: fewer pipeline stages, a
    lower split degree) of those within ``tie`` of the fastest, the fastest of them
    where several are as simple.  Why: where the predictor's error is larger than the
    gaps between the top layouts (``Cluster.tie``), their order is noise, and the
    simpler layout is the safer choice (a pipeline's replay on shared cores missed by
    the most: 4 stages predicted 4-8 % faster than measured)."""
    ranked = sorted(items, key=lambda c: (-rate(c), cost(c)))
    if not ranked or tie <= 0:
        return ranked
    near = [c for c in ranked if rate(c) >= rate(ranked[0]) * (1.0 - tie)]
    first = min(near, key=simplicity)           # (min keeps the first of equals)
    return [first] + [c for c in ranked if c is not first]
