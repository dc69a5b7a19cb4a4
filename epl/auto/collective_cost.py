"""What a collective costs on a cluster's links (``machines.Link``), for the
predictor: a ring all-reduce, EPL's in-process rendezvous, tensor parallelism's
all-reduce within or across nodes, and data parallelism's hierarchical one (within a
node, then across nodes over the node's NICs).  Closed forms, no graph."""


def ring_allreduce_s(nbytes, members, bandwidth, latency):
    """Ring all-reduce: 2 (n-1)/n of the bytes over each member's link."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (members - 1) / members * nbytes / bandwidth + 2 * (members - 1) * latency


def link_allreduce_s(nbytes, members, link, chained=1):
    """An all-reduce over ``members`` ranks of ``link``, ``chained`` collectives one after
    another (their bytes sent once): a ring, or EPL's in-process rendezvous
    (``Link.algorithm``), where the last rank to arrive reduces every rank's tensor in
    one pass: n reads and a write of the size (3 at the 2 ranks it is calibrated on:
    the ring's bytes there) and one latency per collective, whatever the ranks."""
    if link.algorithm != "rendezvous":
        return ring_allreduce_s(nbytes, members, link.bandwidth, link.latency * chained)
    if members <= 1 or nbytes <= 0:
        return 0.0
    return (members + 1) / 3.0 * nbytes / link.bandwidth + 2 * link.latency * chained


def tp_allreduce_s(nbytes, cluster, t):
    if t <= cluster.devices_per_node:
        return link_allreduce_s(nbytes, t, cluster.intra)
    return ring_allreduce_s(nbytes, t, cluster.nic_bandwidth_per_device(),
                            cluster.inter.latency)


def dp_allreduce_s(nbytes, cluster, t, d, chained=1, beside=False):
    """Gradient all-reduce over the d replicas (ranks: t fastest, then d, then p): the
    replicas on one node reduce-scatter over NVSwitch, the nodes all-reduce their shard
    over the NICs, then all-gather within the node.  ``chained``: collectives run one
    after another (EPL's fusion buckets on one communicator): the bytes are sent once,
    the latency paid per collective.  ``beside``: the all-reduce run beside compute on
    the cores it shares with it (``Link.beside_bandwidth`` across the nodes), or None
    where the inter-node link has no such figure or is not crossed."""
    local = max(1, min(d, cluster.devices_per_node // t)) if t < cluster.devices_per_node \
        else 1
    nodes = d // local
    bandwidth = cluster.nic_bandwidth_per_device()
    if beside:
        if nodes <= 1 or cluster.inter.beside_bandwidth is None:
            return None
        bandwidth *= cluster.inter.beside_bandwidth / cluster.inter.bandwidth
    intra = link_allreduce_s(nbytes, local, cluster.intra, chained)
    inter = ring_allreduce_s(nbytes / float(local), nodes, bandwidth,
                             cluster.inter.latency * chained)
    return intra + inter


def dp_step_s(nbytes, first_share, cluster, t, d, chained, backward_s):
    """(the gradient all-reduce alone, what the step pays for it): all but the first
    bucket (``first_share`` of the bytes) hide behind the ``backward_s`` it runs beside;
    between worker processes of one host (``Link.beside_bandwidth``, Cluster.local) the
    transport's work takes the cores from that backward pass, so none of it hides: the
    step pays it at its bandwidth beside compute."""
    if d <= 1:
        return 0.0, 0.0
    alone = dp_allreduce_s(nbytes, cluster, t, d, chained)
    exposed = max(alone * first_share, alone - backward_s) if alone else 0.0
    beside = dp_allreduce_s(nbytes, cluster, t, d, chained, beside=True)
    return alone, max(exposed, beside or 0.0)
