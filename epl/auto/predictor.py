"""``epl.auto.predict``: memory per device and step time of a layout on a cluster, from
the model's graph (``graph_profile``), never from a run.  The formulas are in
docs/plan.md; in short, per pipeline stage and micro-batch:

* compute = matrix-product FLOPs / (peak x efficiency); backward = 2 x forward;
  recomputation adds the blocks' forward;
* tensor parallelism: the graph's row-parallel all-reduces (2 per transformer block
  forward, as many backward and in the recomputed forward), ring over the node's links;
* pipeline: the schedule simulated as events (``schedule``: every micro-batch's forward
  and backward per stage in GPipe's or 1F1B's order, the sends between; devices that
  share cores lend an idle stage's share to the busy ones); the interleaved schedule
  (priced only): (m - 1) x slowest stage + the stages' sum / its chunks;
* stages: contiguous blocks by count (Megatron, the presets) or, on EPL's runtime
  (``Cluster.stage_cut == "epl"``), the cut EPL's ``auto.auto_parallel`` makes of the
  built graph (``Profile.epl_stages``), priced with EPL's own checkpoint rule;
* data parallelism: the gradient all-reduce of the fullest stage (hierarchical: within
  a node, then across nodes over the node's NICs), less what hides behind the last
  micro-batch's backward; the optimizer's update at memory bandwidth; offload's copies."""

from epl.auto import graph_profile, local_step, schedule, shards
from epl.auto.collective_cost import dp_step_s, link_allreduce_s, tp_allreduce_s
from epl.auto.layout import Layout

BUCKET_BYTES = 64 << 20       # gradient fusion bucket (communication.max_splits aside)
EPL_MAX_SPLITS = 5            # communication.max_splits: fusion buckets per step
EPL_COMMUNICATORS = 2         # communication.num_communicators: buckets alternate
SIMULATED_TASKS = 512         # micro-batches x stages simulated as events (below: closed form)
_WIDTH = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}


class Prediction(object):
    """What ``predict`` returns: ``step_time_s``, ``samples_per_s``, ``mfu``,
    ``tflops_per_gpu`` (executed FLOPs incl. recomputation, Megatron's metric),
    ``memory_bytes`` (one entry per pipeline stage: every device of a stage holds the
    same), ``peak_memory_bytes``, ``fits``, ``breakdown`` (seconds and bytes)."""

    def __init__(self, layout, **kw):
        self.layout = layout
        self.__dict__.update(kw)

    def to_dict(self):
        out = {k: v for k, v in self.__dict__.items() if k != "layout"}
        out["layout"] = self.layout.describe()
        return out

    def __repr__(self):
        return ("Prediction(%s: %.4g s/step, %.4g samples/s, MFU %.3f, peak %.3g GiB)"
                % (self.layout.describe(), self.step_time_s, self.samples_per_s, self.mfu,
                   self.peak_memory_bytes / 2.0 ** 30))


def zero_share(profile, d):
    """The fullest device's share of the optimizer state under EPL's ZeRO v1: whole
    variables, the largest first onto the least loaded of the d devices
    (``rewrite.zero.plan_owners``); 1/d when the sizes are not known."""
    sizes = profile.variable_sizes
    if not sizes or d <= 1:
        return 1.0 / d
    load = [0] * d
    for n in sizes:
        load[load.index(min(load))] += n
    return max(load) / float(sum(sizes))


def stages_of(layers, p):
    """Blocks of each stage: contiguous, as even as can be (the first stages get one
    more when p does not divide the blocks)."""
    base, extra = divmod(layers, p)
    out, start = [], 0
    for k in range(p):
        n = base + (1 if k < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _resolve(layout, profile, cluster, global_batch):
    lay = Layout(**{k: getattr(layout, k) for k in (
        "t", "p", "d", "micro_batch_size", "num_micro_batch", "schedule", "chunks",
        "recompute", "zero", "offload", "dtype", "split_head")})
    n = cluster.num_devices
    if lay.d is None:
        if n % (lay.t * lay.p):
            raise ValueError("epl.auto: t x p = %d does not divide the cluster's %d devices"
                             % (lay.t * lay.p, n))
        lay.d = n // (lay.t * lay.p)
    if lay.t * lay.p * lay.d > n:
        raise ValueError("epl.auto: t x p x d = %d > %d devices" % (lay.t * lay.p * lay.d, n))
    if global_batch is None:
        mb = lay.micro_batch_size or profile.rows
        global_batch = mb * (lay.num_micro_batch or 1) * lay.d
    if global_batch % lay.d:
        raise ValueError("epl.auto: global batch %d is not a multiple of d = %d"
                         % (global_batch, lay.d))
    per = global_batch // lay.d
    if lay.micro_batch_size:
        lay.num_micro_batch = per // lay.micro_batch_size
    elif lay.num_micro_batch:
        lay.micro_batch_size = per // lay.num_micro_batch
    else:                           # one micro-batch of the replica's rows
        lay.micro_batch_size, lay.num_micro_batch = per, 1
    if lay.micro_batch_size * lay.num_micro_batch != per or lay.num_micro_batch < 1:
        raise ValueError("epl.auto: %d rows per replica do not make whole micro-batches of "
                         "%s" % (per, lay.micro_batch_size))
    return lay, global_batch


def _in_flight(lay, k):
    """Micro-batches whose activations stage k holds at the schedule's peak (in units
    of the whole stage's activations)."""
    m, p = lay.num_micro_batch, lay.p
    if lay.schedule == "gpipe":
        return m
    if lay.schedule == "interleaved" and p > 1:
        v = lay.chunks
        return min(m * v, 2 * (p - k - 1) + (v - 1) * p + 1) / float(v)
    return min(m, p - k)


def price(profile, layout, cluster, global_batch=None):
    """The Prediction of a resolved Profile (``graph_profile.profile``) and Layout."""
    lay, global_batch = _resolve(layout, profile, cluster, global_batch)
    t, p, d, mb, m = lay.t, lay.p, lay.d, lay.micro_batch_size, lay.num_micro_batch
    dev = cluster.device
    flops_s = dev.flops(lay.dtype)
    amp = lay.dtype in ("fp16", "bf16")
    width = _WIDTH[lay.dtype]
    act_scale = 0.5 if amp else 1.0            # float32 tensors become 16-bit under AMP
    # (in time and on Megatron's GPUs; EPL's AMP on CPU devices keeps float32's: below)
    kept_scale = 1.0 if amp and cluster.stage_cut == "epl" else act_scale

    def split_of(r, what):  # what the split divides: on EPL's runtime or Megatron's
        return shards.split_part(r, what, cluster.stage_cut == "epl")

    def saved(r):
        """Activation bytes per row the backward pass reads, on one device."""
        if not r.saved:
            return 0.0
        b = (r.saved - r.saved_split) + r.saved_split / float(t)
        return b * (1.0 - r.saved_float32 / r.saved * (1.0 - kept_scale))

    def pw(r):
        """Bytes per row the non-product ops write, on one device (AMP: 16-bit)."""
        return (r.pointwise - split_of(r, "pointwise") * (1.0 - 1.0 / t)) * act_scale

    def flops(r):
        return r.flops - split_of(r, "flops") * (1.0 - 1.0 / t)

    if lay.split_head and (p > 1 or t > 1):
        raise ValueError("epl.auto: the split head is priced with data parallelism only "
                         "(EPL refuses it with pipelines; tensor_parallel splits blocks)")
    head = profile.post if lay.split_head and d > 1 else None

    def thin(r):
        """How much slower than the peak the region's products run: thin ones (a small
        M, K or N) below it (``Device.product_share``, measured by Cluster.local)."""
        if not dev.thin_products or not r.flops or not r.flops_by_dim:
            return 1.0
        return sum(f / dev.product_share(dim) for dim, f in r.flops_by_dim.items()) \
            / sum(r.flops_by_dim.values())

    # Cluster.local(products=True): the model's own kernels timed on this machine,
    # alone (one busy device) or shared (every core's device busy; more devices than
    # cores take turns); the rest, and what could not be timed, by FLOPs and bytes
    timings, sigs, op_overhead = None, None, dev.op_overhead
    busy = t * p * d
    regions_all = [profile.pre, profile.post] + list(profile.blocks)

    def region_sigs():
        return set(sig for r in regions_all for sig in list(r.products) + list(r.kernels)
                   + shards.signatures(r.shards, t))
    if cluster.time_products and lay.dtype == "fp32":
        if p > 1 and cluster.stage_cut == "epl":
            regions_all += list(profile.epl_stages(p) or [])
        sigs = region_sigs()
    # One stage, or a whole pipeline, on one machine: the step's dataflow graph replayed
    # on the shared cores (epl.auto.local_step); GC adds the forward kernels it reruns
    flow, whole_step = local_step.flow_of(profile, lay, cluster, head is None)
    # ZeRO and offload here: their own ops, EPL's built step with them replayed less without
    moved = local_step.state_flows(profile, lay, cluster, head is None)
    for f in [flow] + list(moved or []):
        if f is not None:
            sigs = (sigs if sigs is not None else region_sigs()) \
                | set(sig for sig in f["sigs"] if sig is not None)
    if sigs is not None:
        # (a replayed step's cheap kernels pay what the model's step adds to their
        # chains: ``kernel_mix``, probed on its one-device step)
        step = profile.dataflow() if (flow is not None or moved) and profile.dataflow \
            else None
        timings, costs = local_step.timed(sigs, cluster.cores, op_overhead, step)
        op_overhead = costs["op"]
    replayed, update_timed = None, None
    if flow is not None:
        replayed = local_step.replay(flow, timings, costs, profile.input_seconds(),
                                     cluster.cores, flops_s * cluster.devices_per_node,
                                     1 if whole_step else d,
                                     1 if whole_step else min(d, cluster.nodes),
                                     cluster.wake_up,
                                     dev.memory_bandwidth * cluster.devices_per_node)
        update_timed = local_step.update_seconds(
            flow, timings, 1 if whole_step or lay.zero else min(d, cluster.nodes),
            cluster.cores)
    state_moves = 0.0
    if moved is not None:
        with_them, without = [local_step.replay(
            f, timings, costs, profile.input_seconds(), cluster.cores,
            flops_s * cluster.devices_per_node, 1, wake=cluster.wake_up) for f in moved]
        state_moves = max(0.0, with_them - without)

    def timed_kernels(r):
        """The region's other kernels that were timed: {sig: [forward, backward]}."""
        if timings is None:
            return {}
        return dict((sig, n) for sig, n in r.kernels.items() if timings.get(sig))

    def untimed_pw(r):
        """``pw`` less what the timed kernels write (they are priced by their times)."""
        return pw(r) - sum(r.kernel_pointwise.get(sig, 0.0) for sig in timed_kernels(r)) \
            * act_scale

    def untimed_ops(r):
        return r.ops - sum(a + b for a, b in timed_kernels(r).values())

    def kernel_s(sig):
        x = timings[sig]
        return x["alone"] if busy == 1 else x["shared"] * max(1.0, busy / float(cluster.cores))

    def products_s(r, backward):
        """Seconds of the region's products over the micro-batch: timed forward (or
        backward) kernels, the untimed ones by FLOPs (backward = 2 x forward)."""
        if timings is None:
            return (2.0 if backward else 1.0) * flops(r) * thin(r) * mb / flops_s
        def timed_s(counts, split, whole):      # {sig: [forward, backward] runs}
            return sum(n[1 if backward else 0] * kernel_s(sig) for sig, n in
                       counts.items()) * split_share(split, whole)
        sharded = split_of(r, "shards") if t > 1 else {}
        if sharded:
            # the split products at their shards' own times (1/t of the whole one's
            # where the shard could not be timed or read), the others whole
            b = 1 if backward else 0
            kernels = timed_s(r.products, 0.0, 0.0) + sum(
                n[b] * (shard_s(key) - kernel_s(shards.unkey(key)[0]))
                for key, n in sharded.items())
        else:
            kernels = timed_s(r.products, split_of(r, "flops"), r.flops)
        kernels += timed_s(timed_kernels(r), split_of(r, "pointwise"), r.pointwise)
        untimed = r.untimed_flops * split_share(split_of(r, "flops"), r.flops)
        return kernels * mb / float(profile.rows) \
            + (2.0 if backward else 1.0) * untimed * thin(r) * mb / flops_s

    def shard_s(shard_key):
        return shards.seconds(shard_key, t, lambda s: kernel_s(s) if timings.get(s) else None)

    def split_share(part, whole):
        """What is left on one device of a region's work (timed unsplit) of which
        ``part`` of ``whole`` is split t ways."""
        return 1.0 - (part / whole if whole else 0.0) * (1.0 - 1.0 / t)

    def params(r):
        if r is head:                   # the head's matrices split over the d devices
            return (r.params - r.params_split) + r.params_split / float(d)
        return (r.params - r.params_split) + r.params_split / float(t)

    groups = stages_of(profile.layers, p)
    stage_crosses_nodes = t * d >= cluster.devices_per_node and p > 1
    send_bw = cluster.nic_bandwidth_per_device() if stage_crosses_nodes \
        else cluster.intra.bandwidth
    send_lat = cluster.inter.latency if stage_crosses_nodes else cluster.intra.latency
    per_stage, memory, details, forward_s = [], [], [], []
    model_flops = 3 * profile.forward_flops(global_batch)
    executed = model_flops
    # EPL's runtime cuts the stages itself (auto.auto_parallel): by cost, only where one
    # tensor carries everything later ops need; Megatron (the presets) by block count
    staged = profile.epl_stages(p) if p > 1 and cluster.stage_cut == "epl" else None
    bandwidth = dev.memory_bandwidth
    # EPL's automatic checkpoints are separators too (where the model has few, little is
    # recomputed): its share of the activations is read from the built graph (one
    # stage); for pipelines or repeated blocks bounded by the activations without it
    gc_share = None
    if lay.recompute and cluster.stage_cut == "epl":
        gc_share = profile.gc_fraction if p == 1 and profile.gc_fraction else 1.0
    for k, blocks in enumerate(groups):
        regions = [profile.block(i) for i in blocks]
        extra = ([profile.pre] if k == 0 else []) + ([profile.post] if k == p - 1 else [])
        if staged is not None:
            regions, extra = [], [staged[k]]
        recomputed = regions if staged is None else extra
        fwd_block = sum(flops(r) for r in recomputed) * mb
        recompute = fwd_block if lay.recompute else 0.0
        # (timed kernels, products and the others, by their times; the rest by the
        # roofline: bytes over bandwidth, forward and 2 x backward, plus op overhead)
        pointwise = sum(untimed_pw(r) for r in regions + extra) * mb
        n_ops = sum(untimed_ops(r) for r in regions + extra)
        redo = (sum(products_s(r, False) for r in recomputed)
                + sum(untimed_pw(r) for r in recomputed) * mb / bandwidth) \
            if lay.recompute else 0.0
        products = sum(products_s(r, False) + products_s(r, True) for r in regions + extra)
        compute = products + 3 * pointwise / bandwidth + redo + op_overhead * n_ops
        if replayed is not None and not whole_step:
            if lay.recompute and profile.gc_recomputed is not None:
                # what EPL's automatic GC copies (graph_profile: its rule), timed
                redo = sum(n * kernel_s(sig) for sig, n in profile.gc_recomputed.items()
                           if timings.get(sig)) * mb / float(profile.rows)
            compute = replayed + redo
        forward_s.append(sum(products_s(r, False) for r in regions + extra)
                         + (pointwise / bandwidth + op_overhead * n_ops) / 3.0)
        ar = [b * mb * act_scale for r in regions + extra for b in r.allreduce_bytes]
        ar_block = [b * mb * act_scale for r in regions for b in r.allreduce_bytes]
        tp = 2 * sum(tp_allreduce_s(b, cluster, t) for b in ar) if t > 1 else 0.0
        if lay.recompute and t > 1:
            tp += sum(tp_allreduce_s(b, cluster, t) for b in ar_block)
        send = 0.0
        if k < p - 1:
            nxt = staged[k + 1] if staged is not None else profile.block(groups[k + 1][0]) \
                if len(groups[k + 1]) else profile.post
            nbytes = nxt.input_bytes * mb * act_scale
            one = nbytes / t / send_bw + send_lat + (
                (t - 1.0) / t * nbytes / cluster.intra.bandwidth if t > 1 else 0.0)
            send = 2 * one * lay.chunks
        if head is not None:   # its input gathered from every replica, its gradient back
            tp += link_allreduce_s(head.input_bytes * mb * d * act_scale, d, cluster.intra)
        per_stage.append((compute, tp, send))
        n_params = sum(params(r) for r in regions + extra)     # memory
        if k == 0 and k == p - 1:   # a weight tied between embedding and head, held once
            for n_var, where in profile.shared.values():
                if set(where) <= {"pre", "post"}:
                    n_params -= n_var * (len(where) - 1) / float(t)
        weights = n_params * (2 if amp else 4)
        grads = n_params * width if amp else n_params * 4
        # EPL's rewrite keeps each micro-batch's gradients until their sum (measured)
        grad_copies = 1 if cluster.accumulate_in_place else m
        master = n_params * 4 if amp else 0.0
        # EPL's AMP (O1) on its CPU devices keeps the float32 variables and activations
        # and adds 16-bit copies (measured: the GPT and the MLP hold as much as in
        # float32, 230.6 vs 232.2 and 57.9 vs 56.6 MiB): float32's figures + the weights'
        # 16-bit copies, not Megatron's halves
        cast_copies = 0.0
        if amp and cluster.stage_cut == "epl":
            weights, grads, master, cast_copies = n_params * 4, n_params * 4, 0.0, n_params * 2
        slots = n_params * 4 * profile.slots_per_param
        states = master + slots
        zero_grads, held_share = 0.0, 1.0
        if lay.zero:
            share = zero_share(profile, d) if cluster.stage_cut == "epl" and p == 1 \
                else 1.0 / d
            states *= share
            if cluster.stage_cut == "epl":
                # EPL places each variable itself on its owner too, its peers read it
                # there (measured, DP 2: the MLP's variables 24.0 and 18.2 MiB on its
                # two devices, 42.2 without ZeRO; priced whole on each, its ZeRO
                # memory read 22-26 % high)
                held_share = share
            if cluster.stage_cut == "epl" and d > 1:
                # EPL reduces each variable's gradients to its owner: the owner holds
                # the peers' copies of what it owns beside its own (measured: the wide
                # head's owner 97.5 MiB against 71.0 without ZeRO), and the sum of one
                # variable's copies at a time: the largest it owns
                zero_grads = grads * share + (profile.variable_sizes[0] * width
                                              if profile.variable_sizes and p == 1 else 0.0)
        if lay.offload:
            states = 0.0
        flight = _in_flight(lay, k)
        if lay.recompute and gc_share is None:
            kept = sum(r.input_bytes for r in regions) * kept_scale * mb * flight
            working = max([saved(r) for r in regions] or [0.0]) * mb
            acts = kept + working + sum(saved(r) for r in extra) * mb * flight
        else:
            acts = sum(saved(r) for r in regions + extra) * mb * flight * (gc_share or 1.0)
        # a fusion bucket only where gradients are all-reduced (d > 1)
        buffers = (min(grads, BUCKET_BYTES) if d > 1 and cluster.fusion_buffer else 0.0) \
            + (max(ar or [0.0]) if t > 1 else 0.0)
        # the CPU convolution-gradient kernels' scratch (liveness.scratch_bytes; two side
        # by side on a lone device), where the liveness walk below does not count it
        scratch = max([r.scratch for r in regions + extra] or [0]) \
            * (2 if t * p * d == 1 else 1) if cluster.stage_cut == "epl" else 0.0
        # One whole-model stage at the built batch on EPL's runtime: the step's peak is
        # the liveness walk of the graph the session runs (gradients and activations
        # together, as TF frees them; the gradients all wait for EPL's all-reduce, on
        # one device too, where it passes them through: every update waits for them
        # all): ``epl.auto.liveness``; a split model (float32): walked as its split
        walked = p == 1 and (t == 1 or not amp) and not lay.recompute \
            and mb == profile.rows and cluster.stage_cut == "epl" and profile.step_peak
        split_off = head.params_split * (1.0 - 1.0 / d) * 4 if head is not None else 0.0
        if walked:      # (the walk holds the whole head's gradient, and the scratch)
            acts = profile.step_peak(updates_last=True, side_by_side=t * p * d == 1, t=t) \
                - grads - split_off
            scratch = 0.0
        held = weights * held_share
        if lay.offload:     # the variables live on the host: a GPU copies the weights in
            # for the step; EPL's CPU devices read them where they are (measured)
            held = 0.0 if dev.name.startswith("local") else weights
        mem = held + grads * grad_copies + states + acts + buffers + cast_copies + scratch \
            + zero_grads
        memory.append(int(mem))
        details.append(dict(stage=k, blocks=len(blocks) if staged is None else None,
                            params=n_params, weights=weights, held_weights=held,
                            gradients=grads, gradient_copies=grad_copies,
                            reduced=grads - (head.params_split / float(d) * width
                                             if head is not None else 0.0),
                            optimizer_states=states, activations=acts,
                            buffers=buffers, in_flight=flight,
                            variables=sum(len(r.variables) for r in regions + extra),
                            liveness=bool(walked)))
        executed += recompute * m * d * t
    if whole_step and p > d == 1 and not (lay.zero or lay.offload or lay.recompute or amp):
        memory = local_step.placed_memory(flow) or memory     # the built step, walked
        for det, mem in zip(details, memory):
            det.update(liveness=True, placed_bytes=mem)
    memory = local_step.feature_memory(     # GC or AMP on one stage here: built, walked
        profile, lay, cluster, head is None, details[0],
        lambda plain: price(profile, plain, cluster, global_batch).memory_bytes) or memory
    totals = [sum(x) for x in per_stage]
    slowest = max(totals)
    v = lay.chunks if p > 1 else 1
    if whole_step:      # the pipeline's whole step, replayed (epl.auto.local_step)
        makespan = replayed
    elif p > 1 and lay.schedule in ("1f1b", "gpipe") and (cluster.shared_cores
                                                         or m * p <= SIMULATED_TASKS):
        # the schedule as events; devices sharing cores (Cluster.local) lend an idle
        # stage's cores to the busy ones (EPL's cut of the GPT leaves stage 0 the
        # embedding alone: nearly idle).  Long schedules on dedicated devices: the
        # closed form below (the same within 1 % for even stages; the simulation costs
        # ~0.1 s per layout there)
        fwd = [f + x[1] / 3.0 for f, x in zip(forward_s, per_stage)]
        makespan = schedule.simulate(
            fwd, [tot - x[2] - f for tot, x, f in zip(totals, per_stage, fwd)],
            [x[2] / 2.0 for x in per_stage], m, lay.schedule,
            shared=cluster.shared_cores, devices=t * p * d, copies=t * d)
    else:       # the interleaved schedule (priced only): its fill and drain / v
        # ((m - 1) x slowest + the stages' sum for 1F1B and GPipe)
        makespan = m * slowest + (sum(totals) - slowest) / v
    # data-parallel all-reduce, the update, offload
    dp_exposed, dp_total, update, offload, zero_gather = 0.0, 0.0, 0.0, 0.0, 0.0
    for k, det in enumerate(details):
        compute_k = per_stage[k][0]
        # EPL (Cluster.local) reduces the gradients in up to communication.max_splits
        # buckets alternating over num_communicators, each communicator's in a chain
        chained = 1
        if cluster.stage_cut == "epl":
            buckets = min(EPL_MAX_SPLITS, max(1, det["variables"]))
            chained = -(-buckets // EPL_COMMUNICATORS)
        ar_s, exposed = dp_step_s(det["reduced"], min(1.0, BUCKET_BYTES / max(
            det["gradients"], 1.0)), cluster, t, d, chained, compute_k * 2.0 / 3)
        dp_total = max(dp_total, ar_s)
        dp_exposed = max(dp_exposed, exposed)
        state_bytes = det["params"] * (4 + 4 * profile.slots_per_param) / (d if lay.zero else 1)
        # the update reads and writes the state (offload: on the host, priced at the
        # device's bandwidth: the host's is not in the cluster model)
        # EPL on CPU devices (Cluster.shared_variables): a worker's replicas share one
        # copy, updated once with the worker's cores (measured: the MLP's ApplyAdam took
        # 5.6 ms at 1 and at 2 replicas)
        copies = max(1, d // cluster.nodes) if cluster.shared_variables and not lay.zero \
            else 1
        update = update_timed if update_timed is not None else max(
            update, (2 * state_bytes + det["gradients"] + det["weights"])
            / (dev.memory_bandwidth * copies))     # (timed: the updates' own kernels)
        # (EPL's CPU devices, Cluster.shared_variables, share one address space: a
        # variable its owner or the host holds is read in place, nothing is copied;
        # measured: the MLP's DP 2 step 59.9 ms, with ZeRO 58.9, with offload 54.8)
        in_place = cluster.shared_variables and cluster.nodes == 1
        if lay.zero and d > 1 and not in_place:   # each replica updates 1/d: the weights
            ag = link_allreduce_s(det["weights"], d, cluster.intra) / 2.0  # gathered
            zero_gather = max(zero_gather, ag)
        if lay.offload and not in_place:
            offload = max(offload, (det["gradients"] + det["weights"]) / dev.host_bandwidth)
    if lay.offload:
        offload += state_moves
    else:
        zero_gather += state_moves
    step = makespan + dp_exposed + update + offload + zero_gather + dev.run_overhead
    n_dev = t * p * d
    slow = totals.index(slowest)
    breakdown = dict(
        compute_s=m * per_stage[slow][0], tp_comm_s=m * per_stage[slow][1],
        pp_send_s=m * per_stage[slow][2], bubble_s=max(0.0, makespan - m * slowest),
        pipeline_s=makespan,
        dp_allreduce_s=dp_total, dp_exposed_s=dp_exposed, optimizer_s=update,
        offload_s=offload, zero_allgather_s=zero_gather, stages=details,
        global_batch=global_batch, model_flops=model_flops, executed_flops=executed)
    return Prediction(
        lay, step_time_s=step, samples_per_s=global_batch / step,
        mfu=model_flops / (step * n_dev * dev.peak[lay.dtype]),
        tflops_per_gpu=executed / (step * n_dev) / 1e12,
        memory_bytes=memory, peak_memory_bytes=max(memory),
        fits=max(memory) <= dev.memory, devices=n_dev, breakdown=breakdown)


def predict(model_fn, dataset_fn, optimizer_fn, strategy, cluster, global_batch=None,
            layers=None, profile=None, split_variants=None):
    """Predict one strategy (docs/auto.md's list, extended: ``layout``) on ``cluster``
    from a graph built in a fresh ``tf.Graph``, never run.  ``layers``: the model's blocks
    (the built ones repeated); ``profile``: a ``graph_profile.profile`` to reuse;
    ``split_variants``: {t: the model_fn with its own ``epl.split(t)`` scopes}: on
    ``Cluster.local`` a layout of split degree t is EPL's built step of it, replayed."""
    prof = profile or graph_profile.profile(model_fn, dataset_fn, optimizer_fn)
    if layers:
        prof = prof.repeated(layers)
    prof.split_variants = dict(split_variants or prof.split_variants)
    layout = strategy if isinstance(strategy, Layout) else Layout.from_strategy(strategy)
    return price(prof, layout, cluster, global_batch)
