"""A pipeline step simulated as events: every micro-batch's forward and backward on every
stage, in the order the schedule runs them, with the sends between stages.

``simulate(forward, backward, sends, m, schedule)`` returns the makespan.  Each stage
runs its tasks one at a time, in the schedule's order:

* ``gpipe`` (EPL's ``PreferForward``): the m forwards, then the m backwards;
* ``1f1b`` (EPL's ``PreferBackward``): stage k runs p - k forwards (``min(m, p - k)``),
  then alternates one backward and one forward, then the remaining backwards.

A forward of micro-batch i on stage k waits for its forward on stage k - 1 plus the
send; a backward waits for its backward on stage k + 1 plus the send back (and for the
stage's own forward of i).

``shared``: devices that share one machine's cores (``Cluster.shared_cores``: EPL's
virtual CPU devices).  The durations are priced at the machine's total / ``devices``;
while only ``a`` of the ``devices`` devices have work, each runs ``devices / a`` times
as fast (processor sharing), so an idle stage's cores go to the busy ones.  ``copies``:
devices that run each task in lockstep (the replicas and tensor shards of a stage).
"""
import collections


def order(p, m, schedule, k):
    """The tasks of stage ``k`` in the order it runs them: [("F"|"B", micro-batch)]."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - k)
    out = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        out.append(("B", b))
        b += 1
        if f < m:
            out.append(("F", f))
            f += 1
    return out


def simulate(forward, backward, sends, m, schedule="1f1b", shared=False, devices=None,
             copies=1):
    """Makespan of one step.  ``forward[k]``, ``backward[k]``: seconds of one micro-batch
    on stage k; ``sends[k]``: seconds from stage k to k + 1 (either way)."""
    p = len(forward)
    devices = devices or p * copies
    queues = [collections.deque(order(p, m, schedule, k)) for k in range(p)]
    done = {}                                   # (kind, k, i) -> finish time
    running = {}                                # stage -> [task, work left]
    now = 0.0

    def ready_at(kind, k, i):
        """When the inputs of a task are there, or None while one is missing."""
        if kind == "F":
            if k == 0:
                return 0.0
            prev = done.get(("F", k - 1, i))
            return None if prev is None else prev + sends[k - 1]
        own = done.get(("F", k, i))
        if own is None:
            return None
        if k == p - 1:
            return own
        nxt = done.get(("B", k + 1, i))
        return None if nxt is None else max(own, nxt + sends[k])

    while any(queues) or running:
        waits = []
        for k in range(p):
            if k in running or not queues[k]:
                continue
            kind, i = queues[k][0]
            at = ready_at(kind, k, i)
            if at is None:
                continue
            if at <= now + 1e-15:
                queues[k].popleft()
                work = forward[k] if kind == "F" else backward[k]
                running[k] = [(kind, k, i), work]
            else:
                waits.append(at)
        if not running:
            if not waits:
                raise RuntimeError("epl.auto.schedule: the %s schedule deadlocks" % schedule)
            now = min(waits)
            continue
        rate = 1.0
        if shared:
            rate = max(1.0, devices / float(copies * len(running)))
        step = min(left for _, left in running.values()) / rate
        if waits:
            step = min(step, min(waits) - now)
        now += step
        for k in list(running):
            running[k][1] -= step * rate
            if running[k][1] <= 1e-15:
                done[running[k][0]] = now
                del running[k]
    return now
