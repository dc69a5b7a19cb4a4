"""Where a job's workers listen: free ports on one machine, the ports of --machine_list.

Every worker listens twice: TensorFlow's server (its TF_CONFIG address) and EPL's own
collectives (its EPL_COMM_ADDRESSES entry).  On one machine each attempt takes new free
ports (the previous attempt's sockets may still be closing); with --machine_list the ports
are the list's -- worker ``i`` of a machine listens on port + i (TensorFlow) and port +
workers per machine + i (EPL), and machine 0's launcher coordinates restarts on port + 2 x
workers per machine -- so every machine's launcher computes the same table alone.
"""
import random
import socket


def free_ports(n, host="127.0.0.1"):
    """``n`` ports free on ``host`` now (each bound once, then released)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((host, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_port_block(n, host="127.0.0.1", tries=200):
    """The first of ``n`` consecutive free ports (a --machine_list entry uses port .. port +
    2 * workers - 1: TensorFlow's and EPL's collectives')."""
    for _ in range(tries):
        first = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no %d consecutive free ports on %s" % (n, host))


def machine_table(a):
    """(host, first port) of every machine of --machine_list, and workers per machine."""
    machines = [m.strip() for m in a.machine_list.split(",") if m.strip()]
    if a.num_workers % len(machines):
        raise SystemExit("epl-launch: --num_workers %d cannot be divided over %d machines"
                         % (a.num_workers, len(machines)))
    if not 0 <= a.machine_rank < len(machines):
        raise SystemExit("epl-launch: --machine_rank %d is outside the %d machines of "
                         "--machine_list" % (a.machine_rank, len(machines)))
    table = []
    for m in machines:
        host, _, port = m.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit("epl-launch: --machine_list entry %r is not host:port" % m)
        table.append((host, int(port)))
    return table, a.num_workers // len(machines)


def machine_of(a, worker):
    """The --machine_list machine that runs worker ``worker`` (its launch index)."""
    return worker // machine_table(a)[1]


def worker_addresses(a, workers=None):
    """(TF addresses of the job's workers, their EPL communication addresses, the launch
    indices of the workers this machine starts).  ``workers``: the launch indices of the
    workers that take part in this attempt, in rank order (every worker unless some were
    dropped); on one machine they get new free ports."""
    workers = list(range(a.num_workers)) if workers is None else list(workers)
    if not a.machine_list:
        ports = free_ports(2 * len(workers))
        return (["127.0.0.1:%d" % p for p in ports[:len(workers)]],
                ["127.0.0.1:%d" % p for p in ports[len(workers):]], workers)
    table, per = machine_table(a)
    addrs, comm, mine = [], [], []
    for index in workers:
        (host, port), local = table[index // per], index % per
        # worker i of a machine: TF on port + i, EPL's collectives on port + per + i
        addrs.append("%s:%d" % (host, port + local))
        comm.append("%s:%d" % (host, port + per + local))
        if index // per == a.machine_rank:
            mine.append(index)
    return addrs, comm, mine


def control_address(a):
    """(host, port) of the coordinator: machine 0's host, after its workers' ports."""
    table, per = machine_table(a)
    return table[0][0], table[0][1] + 2 * per
