"""A strategy list (docs/auto.md) read as the layout the planner prices.

The list of ``epl.auto.accelerate`` is extended, backward compatibly (every old list
means what it meant), with keys the planner needs:

* ``["tensor_parallel", {"degree": t}]``: the transformer blocks split t ways
  (Megatron-style, the ``epl.split`` blocks of issue 35);
* ``["pipeline", {"num_stages": p, "num_micro_batch": m, "micro_batch_size": b,
  "schedule": "1f1b" | "gpipe" | "interleaved", "chunks": v}]``: the micro-batch size
  or count, the schedule (``1f1b`` is EPL's ``PreferBackward``, ``gpipe`` its
  ``PreferForward``; ``interleaved`` is priced only, EPL does not run it);
* ``["data_parallel", {"degree": d}]``: replicas across workers (default: the devices
  left after t x p);
* ``["zero", {"level": "v1"}]``, ``["amp", {"dtype": "float16" | "bfloat16"}]``,
  ``["gradient_checkpoint", "full"]`` (``"auto"``/``"collection"`` are priced as
  full recomputation of the blocks).
"""
import json
import os

METHODS = ("data_parallel", "accumulation", "pipeline", "split", "tensor_parallel",
           "gradient_checkpoint", "zero", "amp", "offload")
SCHEDULES = ("1f1b", "gpipe", "interleaved")
_DTYPES = {"float16": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16",
           "float32": "fp32", "fp32": "fp32", "tf32": "tf32"}


def read_strategy(strategy):
    """The strategy list from any form a user gives it: the list itself, its JSON text
    (str or bytes) or the path of a file holding that text."""
    if isinstance(strategy, (bytes, str)):
        text = strategy.decode() if isinstance(strategy, bytes) else strategy
        if os.path.exists(text):
            with open(text) as f:
                text = f.read()
        strategy = json.loads(text)
    return strategy


def _items(strategy):
    strategy = read_strategy(strategy)
    out = []
    for item in strategy:
        name, arg = (item, None) if isinstance(item, str) else (item[0], item[1])
        if name not in METHODS:
            raise ValueError("epl.auto: unknown method %r in the strategy; the methods are "
                             "%s" % (name, ", ".join(METHODS)))
        out.append((name, arg))
    return out


class Layout(object):
    """t x p x d, micro-batches, schedule and memory methods of one strategy."""

    def __init__(self, t=1, p=1, d=None, micro_batch_size=None, num_micro_batch=None,
                 schedule="1f1b", chunks=1, recompute=False, zero=None, offload=False,
                 dtype="fp32", split_head=False):
        if schedule not in SCHEDULES:
            raise ValueError("epl.auto: schedule %r; the schedules are %s"
                             % (schedule, ", ".join(SCHEDULES)))
        self.t, self.p, self.d = int(t), int(p), d
        self.micro_batch_size, self.num_micro_batch = micro_batch_size, num_micro_batch
        self.schedule, self.chunks = schedule, int(chunks) if schedule == "interleaved" else 1
        self.recompute, self.zero, self.offload = bool(recompute), zero, bool(offload)
        self.dtype = _DTYPES[dtype]
        # the replicated-backbone / split-head hybrid: the model's last region (its
        # head and loss) split over the d replicas' devices (accelerate's "split")
        self.split_head = bool(split_head)

    @classmethod
    def from_strategy(cls, strategy):
        kw = {}
        for name, arg in _items(strategy):
            arg = arg if isinstance(arg, dict) else {}
            if name == "tensor_parallel":
                kw["t"] = int(arg.get("degree", 1))
            elif name == "data_parallel" and "degree" in arg:
                kw["d"] = int(arg["degree"])
            elif name == "accumulation":
                kw["num_micro_batch"] = int(arg.get("num_micro_batch", 2))
            elif name == "pipeline":
                kw["p"] = int(arg.get("num_stages", 2))
                if "micro_batch_size" in arg:
                    kw["micro_batch_size"] = int(arg["micro_batch_size"])
                else:
                    kw["num_micro_batch"] = int(arg.get("num_micro_batch", 4))
                kw["schedule"] = arg.get("schedule", "1f1b")
                kw["chunks"] = int(arg.get("chunks", 2))
            elif name == "split":
                kw["split_head"] = True
            elif name == "gradient_checkpoint":
                kw["recompute"] = True
            elif name == "zero":
                kw["zero"] = arg.get("level", "v1")
            elif name == "offload":
                kw["offload"] = True
            elif name == "amp":
                kw["dtype"] = arg.get("dtype", "float16")
        return cls(**kw)

    def to_strategy(self):
        out = []
        if self.t > 1:
            out.append(["tensor_parallel", {"degree": self.t}])
        if self.p > 1:
            pipe = {"num_stages": self.p, "num_micro_batch": self.num_micro_batch,
                    "micro_batch_size": self.micro_batch_size, "schedule": self.schedule}
            if self.schedule == "interleaved":
                pipe["chunks"] = self.chunks
            out.append(["pipeline", {k: v for k, v in pipe.items() if v is not None}])
        elif self.num_micro_batch and self.num_micro_batch > 1:
            out.append(["accumulation", {"num_micro_batch": self.num_micro_batch}])
        if self.split_head:         # data parallel, the head split (accelerate's "split")
            out.append("split")
        else:
            out.append(["data_parallel", {"degree": self.d}] if self.d else "data_parallel")
        if self.recompute:
            out.append(["gradient_checkpoint", "auto"])
        if self.zero:
            out.append(["zero", {"level": self.zero}])
        if self.offload:
            out.append("offload")
        if self.dtype in ("fp16", "bf16"):
            out.append(["amp", {"dtype": "float16" if self.dtype == "fp16" else "bfloat16"}])
        return out

    def to_config(self, devices_per_node):
        """The EPL config keys that run this layout (tensor parallelism has no key: it is
        the ``epl.split`` blocks of the model, see the strategy)."""
        cfg = {"cluster.devices_per_worker": devices_per_node}
        if self.p > 1:
            cfg["auto.auto_parallel"] = True
            cfg["pipeline.num_stages"] = self.p
            cfg["pipeline.strategy"] = "PreferForward" if self.schedule == "gpipe" \
                else "PreferBackward"
        if self.num_micro_batch and self.num_micro_batch > 1:
            cfg["pipeline.num_micro_batch"] = self.num_micro_batch
        if self.split_head:
            cfg["cluster.colocate_split_and_replicate"] = True
        if self.recompute:
            cfg["gradient_checkpoint.type"] = "auto"
        if self.zero:
            cfg["zero.level"] = self.zero
        if self.offload:
            cfg["offload.level"] = "v0"
        if self.dtype in ("fp16", "bf16"):
            cfg["amp.level"] = "O1"
            cfg["amp.dtype"] = "float16" if self.dtype == "fp16" else "bfloat16"
        return cfg

    def describe(self):
        s = "t%d p%d d%s mb%s m%s %s" % (self.t, self.p, self.d, self.micro_batch_size,
                                         self.num_micro_batch, self.schedule)
        if self.schedule == "interleaved":
            s += "x%d" % self.chunks
        for flag, name in ((self.recompute, "gc"), (self.zero, "zero"),
                           (self.offload, "offload"), (self.split_head, "split-head")):
            if flag:
                s += " " + name
        return s + " " + self.dtype
