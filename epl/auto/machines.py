"""The machines a plan is made for: ``epl.auto.Cluster`` (not ``epl.core.cluster``, which
is the job's TF_CONFIG cluster).

A cluster is ``nodes`` x ``devices_per_node`` identical devices.  A device has a peak
FLOP/s per dtype, an efficiency per dtype (the one calibration constant of the
time model, docs/plan.md), memory and memory bandwidth, and a host link (PCIe, for
offload).  Links: ``intra`` (NVLink/NVSwitch inside a node) and ``inter`` (InfiniBand:
``nics_per_node`` ports of ``bandwidth`` each).  Bandwidths are bytes/s in one
direction; latencies seconds per ring step.

Presets follow the vendors' datasheets (dense tensor-core peaks, no sparsity):
V100-SXM2-32GB, A100-SXM4-40GB/80GB (8 x HDR 200 Gb/s), H100-SXM5-80GB (8 x NDR 400
Gb/s), in DGX-style nodes of 8 GPUs on NVSwitch.
"""
import copy
import json
import math

from epl.auto import cold_reads, dataflow, local

DTYPES = ("fp32", "tf32", "fp16", "bf16")
GB = 1e9
TFLOPS = 1e12

# One efficiency constant per device type and dtype: the fraction of peak that matrix
# products reach.  A100 fp16/bf16 is fitted on two rows of Megatron-LM's Table 1
# (benchmarks/plan_megatron.py --fit); the other devices and dtypes reuse that value
# (not fitted: no published table of theirs is used here).
FITTED_EFFICIENCY = 0.6405
# ``Cluster.tie`` of Cluster.local (below): predictions this close are ties there
LOCAL_TIE = 0.03
# Cluster.local's ``wake_up`` by the kind of machine (``wake_up_for``): a last-level
# cache at least this large prices a kernel's wake-up as "work", a smaller one as "wait"
LARGE_CACHE_BYTES = 128 << 20


def wake_up_for(cache_bytes):
    """How the replay on this machine's shared cores pays a kernel's wake-up
    (``dataflow.WAKES``), by the kind of machine, told apart by its last-level cache
    (``local.measure``'s ``cache_bytes``; None: "wait").  Measured on three kinds, each
    rule on the same runs repriced: on the Xeon with AMX and 480-504 MiB of L3 "work"
    fits (stop 49: 4.3-7.0 % time median against 6.8-12.7 %; stop 67's run, 71 rows:
    7.2 % / worst 25.4 % against 9.4 % / 30.9 %), on the AMD EPYC and the Xeon with 32-33
    MiB "wait" (stop 57: the GPT's DP 4 +36 % -> +14 %).  Why the kinds differ is not
    known (docs/plan.md, limits)."""
    if cache_bytes and cache_bytes >= LARGE_CACHE_BYTES:
        return "work"
    return "wait"

_PRESETS = {
    "v100-32gb": dict(
        name="V100-SXM2-32GB",
        peak={"fp32": 15.7 * TFLOPS, "tf32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS,
              "bf16": 15.7 * TFLOPS},
        memory=32 * 2 ** 30, memory_bandwidth=900 * GB, host_bandwidth=16 * GB,
        intra=dict(kind="nvlink", bandwidth=150 * GB, latency=3e-6),
        inter=dict(kind="ib-hdr", bandwidth=25 * GB, latency=5e-6, nics_per_node=8)),
    "a100-40gb": dict(
        name="A100-SXM4-40GB",
        peak={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "fp16": 312 * TFLOPS,
              "bf16": 312 * TFLOPS},
        memory=40 * 2 ** 30, memory_bandwidth=1555 * GB, host_bandwidth=32 * GB,
        intra=dict(kind="nvswitch", bandwidth=300 * GB, latency=3e-6),
        inter=dict(kind="ib-hdr", bandwidth=25 * GB, latency=5e-6, nics_per_node=8)),
    "a100-80gb": dict(
        name="A100-SXM4-80GB",
        peak={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "fp16": 312 * TFLOPS,
              "bf16": 312 * TFLOPS},
        memory=80 * 2 ** 30, memory_bandwidth=2039 * GB, host_bandwidth=32 * GB,
        intra=dict(kind="nvswitch", bandwidth=300 * GB, latency=3e-6),
        inter=dict(kind="ib-hdr", bandwidth=25 * GB, latency=5e-6, nics_per_node=8)),
    "h100-80gb": dict(
        name="H100-SXM5-80GB",
        peak={"fp32": 67 * TFLOPS, "tf32": 495 * TFLOPS, "fp16": 989 * TFLOPS,
              "bf16": 989 * TFLOPS},
        memory=80 * 2 ** 30, memory_bandwidth=3350 * GB, host_bandwidth=64 * GB,
        intra=dict(kind="nvswitch", bandwidth=450 * GB, latency=3e-6),
        inter=dict(kind="ib-ndr", bandwidth=50 * GB, latency=5e-6, nics_per_node=8)),
}
PRESETS = tuple(sorted(_PRESETS))


class Device(object):
    """One accelerator: peak FLOP/s and efficiency per dtype, memory, bandwidths."""

    def __init__(self, name, peak, memory, memory_bandwidth, host_bandwidth=16 * GB,
                 efficiency=None, op_overhead=0.0, run_overhead=0.0, thin_products=None):
        self.name = name
        self.peak = {k: float(v) for k, v in peak.items()}
        missing = [d for d in DTYPES if d not in self.peak]
        if missing:
            raise ValueError("epl.auto.Cluster: device %r lacks a peak for %s (give peak "
                             "FLOP/s for each of %s)" % (name, missing, ", ".join(DTYPES)))
        self.memory = int(memory)
        self.memory_bandwidth = float(memory_bandwidth)
        self.host_bandwidth = float(host_bandwidth)
        eff = dict.fromkeys(DTYPES, FITTED_EFFICIENCY)
        eff.update(efficiency or {})
        self.efficiency = {k: float(v) for k, v in eff.items()}
        # CPU executors (Cluster.local): seconds per op and per Session.run; presets: 0
        self.op_overhead = float(op_overhead)
        self.run_overhead = float(run_overhead)
        # A product's speed against the peak by its smallest dimension ({dim: share},
        # measured by Cluster.local; the presets: none, their efficiency is fitted)
        self.thin_products = {int(k): float(v) for k, v in (thin_products or {}).items()}

    def flops(self, dtype):
        """Sustained FLOP/s of matrix products in ``dtype``: peak x efficiency."""
        return self.peak[dtype] * self.efficiency[dtype]

    def product_share(self, dim):
        """The share of ``flops`` a product whose smallest dimension is ``dim`` gets
        (log-linear between the measured dimensions; 1 above the largest)."""
        known = sorted(self.thin_products.items())
        if not known or dim >= known[-1][0]:
            return 1.0
        if dim <= known[0][0]:
            return known[0][1]
        for (d0, s0), (d1, s1) in zip(known, known[1:]):
            if d0 <= dim <= d1:
                w = math.log(float(dim) / d0) / math.log(float(d1) / d0)
                return s0 + w * (s1 - s0)
        return 1.0

    def to_dict(self):
        return dict(name=self.name, peak=self.peak, memory=self.memory,
                    memory_bandwidth=self.memory_bandwidth,
                    host_bandwidth=self.host_bandwidth, efficiency=self.efficiency,
                    op_overhead=self.op_overhead, run_overhead=self.run_overhead,
                    thin_products={str(k): v for k, v in self.thin_products.items()})


class Link(object):
    """A network: bandwidth (bytes/s, one direction, per port) and latency per step.
    ``algorithm``: how an all-reduce over it runs: "ring" (NCCL's, the presets': 2 (n-1)
    steps) or "rendezvous" (EPL's in one process, csrc/collectives.cc: the last rank to
    arrive reduces every rank's tensor in one pass; ``collective_cost.link_allreduce_s``).
    ``beside_bandwidth``: the bandwidth of an all-reduce over it that runs beside compute
    on the same cores (EPL's CPU transports between the processes of one host: their
    work is the cores', ``epl.auto.cross_process_rank.beside_compute``); None: its
    transfers overlap compute for free (a NIC, NVLink)."""

    ALGORITHMS = ("ring", "rendezvous")

    def __init__(self, kind, bandwidth, latency, nics_per_node=None, algorithm="ring",
                 beside_bandwidth=None):
        if algorithm not in self.ALGORITHMS:
            raise ValueError("epl.auto.Link: algorithm must be one of %s, got %r"
                             % (", ".join(self.ALGORITHMS), algorithm))
        if beside_bandwidth is not None and not float(beside_bandwidth) > 0:
            raise ValueError("epl.auto.Link: beside_bandwidth must be > 0 bytes/s or None, "
                             "got %r" % (beside_bandwidth,))
        self.kind = kind
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.nics_per_node = nics_per_node
        self.algorithm = algorithm
        self.beside_bandwidth = None if beside_bandwidth is None else float(beside_bandwidth)

    def to_dict(self):
        out = dict(kind=self.kind, bandwidth=self.bandwidth, latency=self.latency)
        if self.nics_per_node is not None:
            out["nics_per_node"] = self.nics_per_node
        if self.algorithm != "ring":
            out["algorithm"] = self.algorithm
        if self.beside_bandwidth is not None:
            out["beside_bandwidth"] = self.beside_bandwidth
        return out


class Cluster(object):
    """``nodes`` x ``devices_per_node`` devices, an intra-node and an inter-node link."""

    def __init__(self, device, nodes, devices_per_node, intra, inter, name=None):
        if nodes < 1 or devices_per_node < 1:
            raise ValueError("epl.auto.Cluster: nodes and devices_per_node must be >= 1, "
                             "got %r and %r" % (nodes, devices_per_node))
        self.device = device
        self.nodes = int(nodes)
        self.devices_per_node = int(devices_per_node)
        self.intra = intra
        self.inter = inter
        self.name = name or device.name
        # How the runtime holds gradients (memory): accumulated in place over the
        # micro-batches (Megatron; the presets) or one copy per micro-batch summed at the
        # end (EPL's pipeline / accumulation rewrite, measured here: Cluster.local); a
        # fusion bucket beside the gradients (NCCL) or reduced in place (EPL in-process).
        self.accumulate_in_place = True
        self.fusion_buffer = True
        # Where pipeline stages are cut: "even" (contiguous blocks by count, Megatron's;
        # the presets) or "epl" (EPL's automatic cut of the built graph, measured here:
        # Cluster.local; a model priced with repeated blocks falls back to "even").
        self.stage_cut = "even"
        # Devices that share one machine's cores (Cluster.local's virtual devices): an
        # idle device's share goes to the busy ones
        self.shared_cores = False
        # A worker's replicas share one copy of each variable and update it once (EPL on
        # CPU devices: cluster.variable_copies "auto"); GPUs (the presets) mirror it
        self.shared_variables = False
        # Price a model's products by timing each on this machine (Cluster.local with
        # products=True: epl.auto.product_timing), on this many cores
        self.time_products = False
        self.cores = 1
        # Predictions of samples/s closer than this share of the fastest are ties, and
        # ``plan`` ranks the simplest of them first (``planner.rank``): Cluster.local's
        # replay on shared cores misses by ~5 % (its median; docs/plan.md) while its
        # layouts' predictions lie 1-3 % apart.  The presets rank by samples/s alone.
        self.tie = 0.0
        # How a kernel's wake-up is priced in the replay of a step on shared cores
        # (time_products): "wait" (a latency its replica waits out; others' kernels use
        # the cores) or "work" (core-seconds beside theirs): ``dataflow.WAKES``, which
        # says where each fits (docs/plan.md, stop 57); Cluster.local's by the kind of
        # machine (``wake_up_for``)
        self.wake_up = "wait"

    @property
    def num_devices(self):
        return self.nodes * self.devices_per_node

    def nic_bandwidth_per_device(self):
        """Inter-node bytes/s one device gets when every device of a node sends at once."""
        nics = self.inter.nics_per_node or 1
        return self.inter.bandwidth * nics / float(self.devices_per_node)

    @classmethod
    def preset(cls, name, nodes=1):
        """``v100-32gb``, ``a100-40gb``, ``a100-80gb`` or ``h100-80gb``: 8-GPU nodes."""
        key = name.lower()
        if key not in _PRESETS:
            raise ValueError("epl.auto.Cluster.preset: unknown %r; the presets are %s"
                             % (name, ", ".join(PRESETS)))
        spec = copy.deepcopy(_PRESETS[key])
        device = Device(spec["name"], spec["peak"], spec["memory"],
                        spec["memory_bandwidth"], spec["host_bandwidth"])
        return cls(device, nodes, 8, Link(**spec["intra"]), Link(**spec["inter"]),
                   name="%s x %d nodes" % (key, nodes))

    @classmethod
    def local(cls, devices=1, recalibrate=False, path=None, memory_bytes=None, processes=1,
              latency_s=None, transport=None, products=False):
        """This machine's ``devices`` virtual CPU devices as EPL uses them, from a
        short calibration run cached under ~/.cache/epl (``epl.auto.local``).
        ``processes`` P > 1: P worker processes (or namespace hosts) of ``devices``
        each, P nodes whose link is EPL's cross-process all-reduce as calibrated here
        (measured the first time it is asked for; with P ranks where the processes
        outnumber the cores, ``local.crowded_ranks``); ``latency_s``: a one-way latency
        added between them (``local.cluster_dict``).  ``products``: price a model's
        products by timing each on this machine (``epl.auto.product_timing``, cached;
        seconds the first time a model is priced)."""
        transports = ()
        if int(processes or 1) > 1 or latency_s:
            transports = (transport or ("tcp" if latency_s else "shm"),)
        out = cls.from_local(local.calibration(recalibrate, path, transports=transports,
                                               processes=processes),
                             devices, memory_bytes, processes, latency_s, transport)
        out.time_products = bool(products)
        return out

    @classmethod
    def from_local(cls, figures, devices=1, memory_bytes=None, processes=1, latency_s=None,
                   transport=None):
        """``Cluster.local`` from given calibration figures (``local.measure()``, with
        ``local.cross_process(figures, transport)`` for ``processes`` > 1)."""
        out = cls.from_dict(local.cluster_dict(figures, devices, memory_bytes, processes,
                                               latency_s, transport))
        out.calibration = figures
        out.cores = int(figures.get("cores", 1))
        out.tie = LOCAL_TIE
        out.wake_up = wake_up_for(figures["cache_bytes"] if "cache_bytes" in figures
                                  else cold_reads.cache_bytes())
        return out

    def with_nodes(self, nodes):
        out = copy.copy(self)
        out.nodes = int(nodes)
        return out

    def to_dict(self):
        return dict(name=self.name, nodes=self.nodes, devices_per_node=self.devices_per_node,
                    device=self.device.to_dict(), intra=self.intra.to_dict(),
                    inter=self.inter.to_dict(), accumulate_in_place=self.accumulate_in_place,
                    fusion_buffer=self.fusion_buffer, stage_cut=self.stage_cut,
                    shared_cores=self.shared_cores, shared_variables=self.shared_variables,
                    tie=self.tie, wake_up=self.wake_up)

    def to_json(self, path=None):
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d):
        if "preset" in d:
            return cls.preset(d["preset"], nodes=d.get("nodes", 1))
        dev = d["device"]
        device = Device(dev["name"], dev["peak"], dev["memory"], dev["memory_bandwidth"],
                        dev.get("host_bandwidth", 16 * GB), dev.get("efficiency"),
                        dev.get("op_overhead", 0.0), dev.get("run_overhead", 0.0),
                        dev.get("thin_products"))
        out = cls(device, d["nodes"], d["devices_per_node"], Link(**d["intra"]),
                  Link(**d["inter"]), name=d.get("name"))
        out.accumulate_in_place = bool(d.get("accumulate_in_place", True))
        out.fusion_buffer = bool(d.get("fusion_buffer", True))
        out.stage_cut = d.get("stage_cut", "even")
        out.shared_cores = bool(d.get("shared_cores", False))
        out.shared_variables = bool(d.get("shared_variables", False))
        out.tie = float(d.get("tie", 0.0))
        out.wake_up = d.get("wake_up", "wait")
        if out.wake_up not in dataflow.WAKES:
            raise ValueError("epl.auto.Cluster: wake_up must be one of %s, got %r"
                             % (", ".join(dataflow.WAKES), out.wake_up))
        return out

    @classmethod
    def from_json(cls, path_or_text):
        """A cluster from a JSON file (or text): ``to_json``'s form, or
        ``{"preset": "a100-80gb", "nodes": 4}``."""
        text = path_or_text
        if not text.lstrip().startswith("{"):
            with open(path_or_text) as f:
                text = f.read()
        return cls.from_dict(json.loads(text))

    def __repr__(self):
        return "Cluster(%s, %d x %d)" % (self.device.name, self.nodes, self.devices_per_node)
