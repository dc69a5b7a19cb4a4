"""A step on this machine (``Cluster.local`` with timed kernels), replayed: which
dataflow graph stands for a layout, and its ops as ``epl.auto.dataflow`` jobs.

* One stage (data parallelism, in-process or across ``Cluster.local``'s worker
  processes): the model's own step, as the session runs it (Grappler's optimization),
  its d replicas side by side on the shared cores; under AMP the graph EPL builds
  (its 16-bit products between casts).
* A pipeline (1F1B or GPipe): the step EPL's rewrite makes of the model (its stages'
  devices, every micro-batch's clone, the schedule's edges, the gradients' sums),
  replayed whole.  The stages' sums and the schedule missed by 10-19 %: what an idle
  stage lends the busy one depends on its kernels, and the clones' sums and reads are
  ops of their own.

Each op costs its kernel's time in a chain (``product_timing``), plus what the executor
spends beside it, each measured: the wake-up of Eigen's threads for a kernel spread
over the cores (``product_timing.HANDOFF``), a tensor received from another device
(``HOP``), the input pipeline's batch (``product_timing.input_seconds``), a weight
read from memory once a step where the variables outgrow the cache and an activation
read after it has left the cache (``cold_reads``), and for an op without a kernel to
time the executor's own work (``EXECUTOR``).  EPL's collectives that sum a pipeline's
micro-batch gradients on one device move their bytes at the machine's memory bandwidth
(``replay``).  The optimizer's updates are timed too (``update_timing``), on cold
variables, and added after the step (``update_seconds``).

A pipeline's memory is that built step's too: each device's variables and the peak of
its buffers, the step walked in order (``placed_memory``); so is one stage's with
gradient checkpointing or AMP, beside the layout's figure without them
(``feature_memory``).
"""
import copy
import logging

from epl.auto import cold_reads, dataflow, kernel_mix, product_timing

log = logging.getLogger("epl")


def flow_of(profile, lay, cluster, whole_model):
    """(the dataflow standing for the layout's step, whether it is the whole step with
    every replica in it) or (None, False) where the layout is priced by stages:
    ``whole_model``: no part of the model is split, else the split head (``split_head``
    where EPL's built step stands for it)."""
    t, p, d = lay.t, lay.p, lay.d
    if not whole_model:
        return split_head(profile, lay, cluster)
    if t > 1:
        return split_step(profile, lay, cluster)
    if not (cluster.time_products and t == 1 and lay.micro_batch_size == profile.rows
            and profile.dataflow):
        return None, False
    if p == 1 and (cluster.nodes == 1 or cluster.shared_cores):
        if lay.dtype == "fp32":
            return profile.dataflow(), False
        if cluster.stage_cut == "epl" and profile.built_dataflow:
            # (its AMP keys only: GC, ZeRO and offload are priced apart)
            amp = dict((k, v) for k, v in lay.to_config(1).items() if k.startswith("amp."))
            return profile.built_dataflow(amp), False
    if p > 1 and cluster.nodes == 1 and cluster.stage_cut == "epl" \
            and lay.schedule in ("1f1b", "gpipe") and profile.built_dataflow:
        return profile.built_dataflow(lay.to_config(p * d)), True
    return None, False


def split_head(profile, lay, cluster):
    """(EPL's built step of the split head: the data-parallel backbone on the d devices,
    the head's layer split over them, every replica in it; True) where the layout is
    the plain split head on this machine's devices, else (None, False).  Priced by
    region (its kernels summed, no overlap) it read +17 ... +28 % (the wide head, stops
    62-65); standing it on the model's replayed data-parallel step worse (+28 / +57 %):
    the split head's step does much less than a replica's."""
    if not (lay.split_head and _replicas_here(profile, lay, cluster)
            and not (lay.recompute or lay.zero or lay.offload)):
        return None, False
    flow = _built(profile, lay.to_config(lay.d), lay, "region")
    return flow, flow is not None


def split_step(profile, lay, cluster):
    """(EPL's built step of the model's own ``epl.split(t)`` variant, ``predict``'s
    ``split_variants``: its t x d devices and every replica in it; True) where the layout
    is one float32 stage of split degree t at the dataset's batch on this machine's
    devices with timed kernels, without GC, ZeRO or offload; else (None, False): priced
    by region.  By region (the split kernels timed as shards and summed, the split's
    collectives by the link) the MLP's and the GPT's TP 2 read -9 and -12 % on TF 2.x,
    as the region pricing of their one device reads -9 %: what overlaps in a step is
    not in a sum, and EPL's split adds ops of its own (the partial sums of row-parallel
    layers, the slices, the whole tied head on the first device); replayed -4 and -6 %
    (stop 71).  Its memory stays the whole model's step walked as its split
    (``step_graph.split_share``): this step walked read the MLP's TP 2 at 23.9 MiB, its
    runs 24.3 on TF 2.x and 27.6 on TF 1.15 (-13.5 %: an under-prediction is an OOM);
    the split walk 28.7."""
    model = (profile.split_variants or {}).get(lay.t)
    if not (model and _one_stage_here(profile, lay, cluster)
            and not (lay.recompute or lay.zero or lay.offload)):
        return None, False
    flow = _built(profile, lay.to_config(lay.t * lay.d), lay, "region", model)
    return flow, flow is not None


def _replicas_here(profile, lay, cluster):
    """Whether the layout is one stage of d > 1 whole fp32 replicas (``_one_stage_here``):
    where a built step of it (the split head's; ZeRO's or offload's) is replayed."""
    return lay.t == 1 and lay.d > 1 and _one_stage_here(profile, lay, cluster)


def _one_stage_here(profile, lay, cluster):
    """Whether the layout is one fp32 stage at the dataset's batch on this machine's
    devices with timed kernels, and EPL's built step of it can be had."""
    return bool(cluster.time_products and lay.p == 1 and lay.dtype == "fp32"
                and cluster.nodes == 1 and cluster.stage_cut == "epl"
                and lay.micro_batch_size == profile.rows and profile.built_dataflow)


def _built(profile, config, lay, fallback, model=None):
    """``profile.built_dataflow(config)`` (of ``model``, the model's split variant, where
    given), or None with a warning that ``lay`` is priced by ``fallback`` instead: the
    functions must be importable from another process (``epl_built_dataflow``; not a
    lambda, not a notebook's)."""
    try:
        if model is not None:
            return profile.built_dataflow(config, model)
        return profile.built_dataflow(config)
    except Exception as e:  # pylint: disable=broad-except
        log.warning("epl.auto: %s priced by %s: EPL's built step could not be made (%s)",
                    lay.describe(), fallback, e)
        return None


def state_flows(profile, lay, cluster, whole_model):
    """(EPL's built data-parallel step with the layout's ZeRO or offload, the same step
    without them) where the layout is one stage of d > 1 replicas on this machine's
    devices, else None.  On EPL's CPU devices a variable's owner or the host is read in
    place (nothing is copied), but the rewrite adds ops and device crossings of its own,
    one or more per variable and replica (measured: the corpus mini-BERT's DP 2 step,
    3.6-3.8 ms, took 0.3-0.4 ms more with ZeRO and 0.7 ms more with offload; the
    model's own step replayed said neither)."""
    if not ((lay.zero or lay.offload) and whole_model
            and _replicas_here(profile, lay, cluster)):
        return None
    config = lay.to_config(lay.d)
    plain = dict((k, v) for k, v in config.items() if k not in ("zero.level", "offload.level"))
    return profile.built_dataflow(config), profile.built_dataflow(plain)


def placed_memory(flow):
    """Each device's bytes at the peak of a pipeline's built step, in the devices'
    order: the variables EPL placed there and the step's own peak there
    (``liveness.device_peaks``: the whole step walked in order; the stages share the
    host's memory), as ``epl.auto.search`` measures a run; None where the flow has no
    placed devices."""
    placed = [(held + peak) for device, held, peak in flow.get("memory") or () if device]
    return placed or None


def feature_memory(profile, lay, cluster, whole_model, details, without):
    """Each stage's bytes where the layout is one stage of whole replicas on this
    machine's devices with gradient checkpointing or AMP (no ZeRO or offload), what
    they came from added to ``details`` (the stage's breakdown); else None.
    ``without(layout)``: a layout's memory as priced.

    The closed form prices GC by the share of the activations EPL's checkpoints keep,
    and AMP by the weights' 16-bit copies; both missed where the step's peak does not
    lie where the activations are summed (TF 2.x, the conv net's DP 2: GC under by 18 %,
    AMP by 13 %; the GPT's GC over by 14-17 %).  EPL's step with the feature and the
    same step without it are built with the layout's d replicas and walked
    (``placed_memory``: a device's convolution gradients one at a time while another
    device works).  The data-parallel walk of the model's own step holds every gradient
    for the all-reduce, the built step's walk does not (EPL's collective writes into a
    buffer it keeps), so the step's peak is the larger of the layout's without the
    feature, lowered by what the feature takes away in the built step (never raised:
    what AMP adds lies in the forward pass, not where the gradients wait), and the
    feature's built step itself (stop 62: every DP 2 row of GC and AMP within
    -2.3 ... +7.9 % on both lines)."""
    if not ((lay.recompute or lay.dtype in ("fp16", "bf16")) and lay.t == 1
            and lay.p == 1 and not lay.zero and not lay.offload and whole_model
            and cluster.stage_cut == "epl" and lay.micro_batch_size == profile.rows
            and profile.built_dataflow):
        return None
    plain = copy.copy(lay)
    plain.recompute, plain.dtype = False, "fp32"
    flow = _built(profile, lay.to_config(lay.d), lay, "the closed form")
    plain_flow = flow and _built(profile, plain.to_config(lay.d), lay, "the closed form")
    if not plain_flow:
        return None
    walks = [placed_memory(f) for f in (flow, plain_flow)]
    if not all(walks):
        return None
    walked, walked_plain = max(walks[0]), max(walks[1])
    plain_memory = without(plain)
    memory = [int(max(m + min(0.0, walked - walked_plain), walked)) for m in plain_memory]
    details.update(walked_feature_bytes=walked, walked_plain_bytes=walked_plain,
                   without_feature_bytes=plain_memory[0])
    return memory


def timed(sigs, cores, op_overhead, step=None):
    """(the kernels' timings, the executor's costs: {"op": an op without a kernel,
    "handoff": a lone run's hand-off, "hop": a device crossing, "cold": the cold-read
    probe, "mix": what a cheap kernel adds beyond its chain in a step}); ``op_overhead``:
    the op's cost where it was not measured; ``step``: the model's one-device step
    (``step_graph.dataflow``), whose cheap kernels in order are the ``kernel_mix``
    probe (None: no probe, nothing added)."""
    sigs = set(sigs) | set(s for s in (step or {}).get("sigs", ()) if s is not None)
    timings = product_timing.timed(
        sigs | {product_timing.EXECUTOR, product_timing.HANDOFF, product_timing.HOP,
                cold_reads.SIGNATURE},
        cores)
    costs = dict(
        op=(timings.pop(product_timing.EXECUTOR) or {}).get("alone", op_overhead),
        handoff=handoff_seconds(timings),
        hop=(timings.pop(product_timing.HOP) or {}).get("alone", 0.0),
        cold=timings.pop(cold_reads.SIGNATURE, None), mix=0.0)
    if step is not None:
        seq = kernel_mix.sequence(step, timings)
        costs["mix"] = kernel_mix.excess(seq, timings, kernel_mix.timed(seq, cores))
    return timings, costs


# A kernel that runs on one thread: its chain takes under this a copy.
ONE_THREAD_S = 1e-6
ONE_THREAD_LEAST = 5


def handoff_seconds(timings):
    """What a one-thread kernel's lone run costs beyond its chain (the executor's
    hand-off, which each kernel's wake-up is measured net of): the median over the
    model's timed one-thread kernels (``ONE_THREAD_S``), else ``HANDOFF``'s own.  One
    probe read 0-20 us from model to model in one run (stop 61: 19.6 us for the
    mini-BERT in both of its rounds, 0 for others), while the median over a model's
    14-130 such kernels read 5.4-6.7 us for every model."""
    one_thread = sorted(
        x["first"] - x["alone"] for sig, x in timings.items()
        if x and "first" in x and x["alone"] < ONE_THREAD_S
        and not sig.startswith('["update"') and not sig.startswith('["executor"'))
    if len(one_thread) >= ONE_THREAD_LEAST:
        return one_thread[len(one_thread) // 2]
    probe = timings.get(product_timing.HANDOFF) or {}
    return probe.get("first", 0.0) - probe.get("alone", 0.0)


def update_seconds(flow, timings, processes=1, cores=1):
    """Seconds the optimizer's updates add after the replayed step, or None where the
    flow holds none or one was not timed: each device's updates one after another,
    cold (``update_timing``), the devices side by side.  EPL's replicas in one process
    update one copy of the variables, once, with the machine's cores (ZeRO: each its
    share, side by side); ``processes`` worker processes on the shared ``cores`` each
    update their own copy at once.  Measured, one device: the wide head's step took
    4.6 ms more with its Adam updates than without (their cold chains: 4.8 ms), the
    MLP's 6 ms (3.8)."""
    updates = flow.get("updates") or ()
    times = [timings.get(flow["sigs"][i]) for i, _ in updates]
    if not updates or not all(times):
        return None
    per_device = {}
    for (_, device), x in zip(updates, times):
        seconds = x["alone"] if processes <= 1 \
            else x["shared"] * max(1.0, processes / float(cores))
        per_device[device] = per_device.get(device, 0.0) + seconds
    return max(per_device.values())


def replay(flow, timings, costs, input_seconds, cores, machine_flops, copies, processes=1,
           wake="wait", bandwidth=None):
    """Seconds of ``copies`` replicas of ``flow`` in ``processes`` worker processes on
    ``cores`` shared cores (the optimizer's updates as bare ops: ``update_seconds``
    prices them); ``wake``: how a kernel's wake-up is paid (``dataflow.WAKES``,
    ``Cluster.wake_up``); ``bandwidth``: the machine's memory bytes/s, at which EPL's
    collectives on one device (a pipeline's micro-batch sums) move their bytes over
    every core (None: they cost what an op without a kernel does)."""
    jobs = []
    # (a weight read from memory once per process: its replicas share the variables)
    cold = cold_reads.per_byte(costs.get("cold"), flow.get("state", 0)) \
        * processes / float(max(copies, processes))
    reads = flow.get("reads") or [0] * len(flow["sigs"])
    # (an activation read after it has left the cache: each replica reads its own)
    acts = flow.get("cold") or [0] * len(flow["sigs"])
    act_cold = cold_reads.per_activation_byte(costs.get("cold"))
    mix = costs.get("mix", 0.0)
    pulls = set(flow.get("inputs", ()))
    updates = set(i for i, _ in flow.get("updates") or ())
    places = flow.get("devices") or [""] * len(flow["sigs"])  # (a built, placed step's)
    sums = dict(flow.get("sums") or ()) if bandwidth else {}
    for i, (sig, f) in enumerate(zip(flow["sigs"], flow["flops"])):
        x = timings.get(sig) if sig is not None and i not in updates else None
        if i in pulls:              # the input pipeline's batch: its own time
            jobs.append((max(input_seconds, costs["op"]), 1.0, 0.0, (places[i], None)))
        elif i in sums:             # a micro-batch sum: its bytes over every core
            jobs.append((max(sums[i] / float(bandwidth), costs["op"]) * cores,
                         float(cores), 0.0, (places[i], None)))
        elif x:                     # (a weight read from memory: ``cold_reads``; a
            # cheap kernel after different ones: ``kernel_mix``)
            extra = reads[i] * cold + acts[i] * act_cold \
                + (mix if kernel_mix.is_cheap(sig, x) else 0.0)
            jobs.append(dataflow.job(x["alone"] + extra, x["shared"] + extra, cores,
                                     x.get("first", 0.0) - x["alone"] - costs["handoff"])
                        + ((places[i], sig),))
        elif f:                     # an untimed product: by FLOPs, on every core
            jobs.append((f / machine_flops * cores, float(cores), 0.0, (places[i], i)))
        else:
            jobs.append((costs["op"], 1.0, 0.0, (places[i], None)))
    for i, n in enumerate(flow.get("hops") or ()):  # tensors received from another device
        if n:
            jobs[i] = (jobs[i][0] + n * costs["hop"],) + tuple(jobs[i][1:])
    return dataflow.makespan(jobs, flow["deps"], cores, copies, processes, wake)
