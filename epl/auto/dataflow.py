"""A step's ops as TensorFlow's executor runs them on one machine's shared cores.

Summing each kernel's time alone over-prices a step on EPL's CPU devices: the executor
runs every ready op at once, and kernels that use the cores poorly alone (a ReLU
gradient, a thin product's weight gradient) leave cores to the independent ops beside
them (measured: the TF-Slim ResNet's kernels summed 75 ms alone, its step took 56 ms;
the MLP's 40 and 34 ms).  So for a step of one stage, the planner replays the step's
dataflow graph as events:

* each op is a job of ``work`` core-seconds that can use up to ``width`` cores: from
  its times alone (the machine's cores to itself) and shared (one copy per core at
  once, ``product_timing``): ``work`` = shared, ``width`` = shared / alone (1..cores);
* the executor starts ready ops in order, at most ``cores`` at once (its inter-op
  pool), each device's cheap ops (a few microseconds, on one thread) one at a time,
  and the running ones share the cores, each up to its width (water-filling:
  processor sharing);
* ``copies`` replicas of the graph (data parallelism on virtual devices of one process,
  or across worker processes on this machine) run side by side on the same cores;
* different kernels spread over the cores on different devices at once (a pipeline's
  stages) get no more from the cores than one after the other: each then needs all
  the cores for its time alone (``_widths``).  Two copies of one kernel (data
  parallelism; a pipeline of identical layers) and the kernels of one device's step
  keep their widths (measured: the one-device steps and in-process replicas replay
  within 10 %; the pipelines read 1.01-1.15x faster than their micro-batches one
  after another, where the widths alone said 1.20-1.41x).  Worker processes more
  than the cores are different kernels to each other: they take turns.

Ops without a time (views, shape arithmetic, the variables) cost nothing but keep the
order.
"""
import collections
import heapq


INLINE_S = 20e-6         # seconds alone below which a kernel runs on one thread
# How a kernel's wake-up (its lone run's cost beyond its chain) is paid (``makespan``):
# "wait": its replica waits it out holding no cores, so another replica's or stage's
# kernels use the cores meanwhile and the wake-ups of replicas started together overlap
# (stop 57, the small-cache kinds of machine: the GPT's DP 2 +17.6 % -> +0.5 %, DP 4
# +36.3 % -> +13.8 %); "work": core-seconds at the kernel's width, which another
# replica's kernels share the cores with (stop 49, the Xeon with 504 MiB of L3).
# Cluster.local chooses by the machine's last-level cache (``machines.wake_up_for``).
WAKES = ("wait", "work")


def job(alone, shared, cores, wake=0.0):
    """(work in core-seconds, width in cores, wake-up in seconds) of a kernel timed
    ``alone`` and ``shared`` (one copy per core) in chains.  A kernel under
    ``INLINE_S`` alone runs on one thread (Eigen does not split small work): its shared
    time measures the executor running two copies, not the cores (measured: the corpus
    mini-BERT's 2 replicas ran 1.33x as long as 1, its kernels' shared times said 2x).
    ``wake``: what a kernel spread over the cores pays when it starts with no other one
    of its replica and device running (``product_timing.HANDOFF``); none for one
    thread."""
    alone, shared = max(alone, 0.0), max(shared, 0.0)
    if alone < INLINE_S:
        return alone, 1.0, 0.0
    width = min(float(cores), max(1.0, shared / alone))
    return alone * width, width, (max(0.0, wake) if width > 1.0 else 0.0)


def makespan(jobs, deps, cores, copies=1, processes=1, wake="wait"):
    """Seconds from the first op to the last of ``copies`` replicas of the graph, in
    ``processes`` worker processes (the copies split evenly, in order).

    ``jobs[i]``: (work, width), (work, width, wake) or (work, width, wake, place) of op
    i (work 0: instant; wake: what it pays when it starts with no other op of its own
    copy and device wider than one core working: a lone run's cost beyond its chain,
    Eigen's threads woken and its inputs first touched; another replica's or stage's
    kernel beside it does not spare it that; ``wake`` says how it is paid: ``WAKES``;
    place: (its device, its kernel) or None, ``_widths``); ``deps[i]``: the indices of
    the ops op i waits for (all below i: a topological order). Each process's executor
    starts at most ``cores`` ops at once, and each device's runs its cheap ops (one
    thread, under ``INLINE_S``; the ops without a kernel) one at a time, beside its
    wider ones and other devices' (measured: the corpus mini-BERT's step, 1305 ops of
    1-3 us on one device, took 2.49 ms, its ops' times one after another 2.33 ms and its
    update 0.08; two cheap ops at a time replayed it in 1.95 ms; its 2 replicas on 2
    devices ran 1.3x as long as 1). More processes than cores are different kernels to
    each other (``_widths``): each process's pool is as wide as the machine, and they
    take turns (measured: 3 processes on 2 cores took as long as their steps one after
    another: the GPT 540 ms, 3 x 178; 2 processes ran 9-12 % slower than 2 replicas in
    one process, which is how they are replayed)."""
    if wake not in WAKES:
        raise ValueError("dataflow.makespan: wake must be one of %s, got %r"
                         % (", ".join(WAKES), wake))
    n = len(jobs)
    users = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for j in set(ds):
            users[j].append(i)
    waiting = [[len(set(ds)) for ds in deps] for _ in range(copies)]
    ready, order = [], 0           # (arrival, copy, op): the executor's queue, in order
    running = []                   # [copy, op, work left, wake-up left ("wait")]
    now = 0.0

    def release(c, i):
        nonlocal order
        stack = [i]
        while stack:                # instant ops finish as soon as they are ready
            k = stack.pop()
            for u in users[k]:
                waiting[c][u] -= 1
                if waiting[c][u] == 0:
                    if jobs[u][0] <= 0.0:
                        stack.append(u)
                    else:
                        heapq.heappush(ready, (order, c, u))
                        order += 1

    sources = [i for i in range(n) if not deps[i]]
    for c in range(copies):
        for i in sources:
            if jobs[i][0] <= 0.0:
                release(c, i)
            else:
                heapq.heappush(ready, (order, c, i))
                order += 1
    slots = max(1, int(cores))          # each process's executor: its own pool
    process = lambda c: c * processes // copies   # noqa: E731
    crowded = processes > cores

    def lane(c, i):
        """The device whose executor runs op i of copy c one cheap op at a time, or None
        for an op that is not cheap."""
        if jobs[i][1] > 1.0 or jobs[i][0] >= INLINE_S:
            return None
        return (c, _device(jobs[i]))
    while ready or running:
        busy = collections.Counter(process(c) for c, _, _, _ in running)
        lanes = set(lane(c, i) for c, i, _, _ in running) - {None}
        held = []                   # ready, their process's pool or device's lane full
        while ready and len(running) < slots * processes:
            entry = heapq.heappop(ready)
            _, c, i = entry
            own = lane(c, i)
            if busy[process(c)] >= slots or own in lanes:
                held.append(entry)
                continue
            if own is not None:
                lanes.add(own)
            busy[process(c)] += 1
            work, wait = jobs[i][0], 0.0
            if len(jobs[i]) > 2 and jobs[i][2] > 0.0:
                mine = (c, _device(jobs[i]))
                if not any(jobs[k][1] > 1.0 and (c2, _device(jobs[k])) == mine
                           for c2, k, _, w in running if w <= 0.0):
                    if wake == "wait":
                        wait = jobs[i][2]
                    else:
                        work += jobs[i][2] * jobs[i][1]
            running.append([c, i, work, wait])
        for entry in held:
            heapq.heappush(ready, entry)
        working = [e for e in running if e[3] <= 0.0]
        widths = _widths(jobs, [(process(c) if crowded else 0, i) for c, i, _, _ in working],
                         cores)
        # (work is counted at the op's own width: at a wider one, each core does less)
        rates = [given * jobs[i][1] / w for (_, i, _, _), given, w in
                 zip(working, _share(widths, float(cores)), widths)]
        step = min([left / rate for (_, _, left, _), rate in zip(working, rates)]
                   + [e[3] for e in running if e[3] > 0.0])
        now += step
        rate_of = dict((id(e), r) for e, r in zip(working, rates))
        still = []
        for entry in running:
            if entry[3] > 0.0:          # waking: holds its executor thread, no cores
                entry[3] -= step
                if entry[3] <= 1e-12:
                    entry[3] = 0.0
                still.append(entry)
                continue
            entry[2] -= rate_of[id(entry)] * step
            if entry[2] <= 1e-12:
                release(entry[0], entry[1])
            else:
                still.append(entry)
        running = still
    return now


def _device(job):
    """The device of a job with a place, else "" (a replica's step is one device)."""
    return job[3][0] if len(job) > 3 and job[3] else ""


def _widths(jobs, running, cores):
    """The width each running op ((its process where the processes crowd the cores,
    else 0; its index)) uses the cores at: its own, unless ops spread over the cores
    run at once on different devices and are different kernels (their ``place``:
    (device, kernel); in different crowding processes, always different); then each
    spread one needs all the cores for its time alone (measured on 2 cores: chains of
    two different large products on two devices took 24.2 ms side by side, 25.3 one
    after the other; their widths, from two copies of the same kernel in one process,
    said 20.4)."""
    spread = [(g, jobs[i][3]) for g, i in running
              if jobs[i][1] > 1.0 and len(jobs[i]) > 3 and jobs[i][3]]
    devices = set((g, device) for g, (device, _) in spread)
    kernels = set((g, kernel) for g, (_, kernel) in spread)
    if len(devices) < 2 or len(kernels) < 2:
        return [jobs[i][1] for _, i in running]
    return [float(cores) if jobs[i][1] > 1.0 else 1.0 for _, i in running]


def _share(widths, cores):
    """Cores for each running op: equal shares, none above its width (water-filling)."""
    out = [0.0] * len(widths)
    left, todo = cores, sorted(range(len(widths)), key=lambda k: widths[k])
    for pos, k in enumerate(todo):
        out[k] = min(widths[k], left / (len(todo) - pos))
        left -= out[k]
    return out
