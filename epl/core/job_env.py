"""Which job this process belongs to, read from the environment a cluster manager gives it.

Pure: ``discover(environ)`` takes an environment (a dict) and returns a ``Job`` (or None
for a process started alone); nothing here binds a port or reads a file.  The sources, in
the order they are tried:

1. ``TF_CONFIG`` (``epl-launch`` writes it, as do Kubeflow's TFJob and users' own
   schedulers): the job is complete, no rendezvous needed.
2. Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` /
   ``_LOCAL_SIZE``) when it is set: ``mpirun`` inside a Slurm allocation leaves the
   allocation's ``SLURM_*`` variables in its ranks, which describe its daemons, not them.
3. Slurm's ``srun`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``,
   ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``,
   ``SLURM_JOB_ID``, ``SLURM_STEP_ID``).  Only a task of a step (``SLURM_STEP_ID`` set):
   a batch script's own shell has ``SLURM_PROCID=0`` and the allocation's task count,
   but it is one process, not a task of the job.
4. MPICH / Intel MPI (``PMI_RANK`` / ``PMI_SIZE``) and PMIx launchers (``PMIX_RANK``
   with ``PMIX_SIZE`` or ``OMPI_COMM_WORLD_SIZE``).

A job of one task is no job (None): the process trains alone, as without a manager.
"""
import collections
import re

TF_CONFIG = "TF_CONFIG"
SLURM = "slurm"
OPEN_MPI = "openmpi"
PMI = "pmi"
PMIX = "pmix"

# rank: this task's index in the job; size: the job's tasks; local_rank / local_size:
# among the tasks of this node (None when the manager does not say); node_id: this node's
# index; hosts: the job's nodes in order (None when unknown); key: what names this job's
# step uniquely on its nodes (its rendezvous folder); multi_node: tasks on several nodes
# (None when unknown); host: this node's name as the manager knows it (or None).
Job = collections.namedtuple(
    "Job", "source rank size local_rank local_size node_id hosts key multi_node host")


class JobEnvError(ValueError):
    """The environment names a job but does not describe it consistently."""


def discover(environ, ppid=None):
    """The job ``environ`` describes, or None when this process runs alone (no manager, or
    a job of one task).  ``ppid``: the parent's pid, which names an MPI job whose launcher
    gives no job id (every rank of a node is a child of the same launcher process)."""
    if environ.get(TF_CONFIG, "").strip():
        return Job(TF_CONFIG, None, None, None, None, None, None, None, None, None)
    for reader in (_open_mpi, _slurm, _pmi, _pmix):
        job = reader(environ, ppid)
        if job is not None:
            return job if job.size > 1 else None
    return None


def _int(environ, name, source):
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise JobEnvError("%s: %s=%r is not an integer." % (source, name, raw))


def _check(source, rank, size, local_rank=None, local_size=None):
    if size is None or size < 1:
        raise JobEnvError("%s: the job's size is missing or below 1 (%r)." % (source, size))
    if not 0 <= rank < size:
        raise JobEnvError("%s: rank %d is outside the job's %d tasks." % (source, rank, size))
    if local_rank is not None and local_rank < 0:
        raise JobEnvError("%s: local rank %d is negative." % (source, local_rank))
    if local_size is not None and local_rank is not None and local_rank >= local_size:
        raise JobEnvError("%s: local rank %d is outside this node's %d tasks."
                          % (source, local_rank, local_size))


def _slurm(environ, ppid):
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if environ.get("SLURM_PROCID") is None or step is None:
        return None
    name = "Slurm"
    rank = _int(environ, "SLURM_PROCID", name)
    size = _int(environ, "SLURM_STEP_NUM_TASKS", name)
    if size is None:
        size = _int(environ, "SLURM_NTASKS", name)
    if size is None:
        size = _int(environ, "SLURM_NPROCS", name)
    local_rank = _int(environ, "SLURM_LOCALID", name)
    node_id = _int(environ, "SLURM_NODEID", name)
    _check(name, rank, size, local_rank)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    hosts = expand_hostlist(nodelist) if nodelist else None
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES", name)
    if nnodes is None and hosts is not None:
        nnodes = len(hosts)
    local_size = None
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node and node_id is not None:
        counts = expand_tasks_per_node(per_node)
        if node_id < len(counts):
            local_size = counts[node_id]
    job_id = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))
    if not job_id:
        raise JobEnvError("Slurm: SLURM_PROCID is set but SLURM_JOB_ID is not.")
    host = environ.get("SLURMD_NODENAME") or (
        hosts[node_id] if hosts and node_id is not None and node_id < len(hosts) else None)
    return Job(SLURM, rank, size, local_rank, local_size, node_id, hosts,
               "slurm-%s.%s" % (job_id, step), None if nnodes is None else nnodes > 1, host)


def _mpi_key(environ, ppid, prefix):
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid",
                 "PMI_JOBID", "MPI_JOBID"):
        if environ.get(name):
            return "%s-%s" % (prefix, re.sub(r"[^A-Za-z0-9_.-]", "_", environ[name]))
    if ppid is None:
        raise JobEnvError("%s: no job id in the environment (PMIX_NAMESPACE, ...) and no "
                          "parent process to name the job by." % prefix)
    return "%s-ppid%d" % (prefix, ppid)


def _open_mpi(environ, ppid):
    if environ.get("OMPI_COMM_WORLD_RANK") is None:
        return None
    name = "Open MPI"
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", name)
    size = _int(environ, "OMPI_COMM_WORLD_SIZE", name)
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", name)
    local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", name)
    node_id = _int(environ, "OMPI_COMM_WORLD_NODE_RANK", name)
    _check(name, rank, size, local_rank, local_size)
    multi = None if local_size is None else local_size < size
    return Job(OPEN_MPI, rank, size, local_rank, local_size, node_id, None,
               _mpi_key(environ, ppid, "ompi"), multi, None)


def _pmi(environ, ppid):
    if environ.get("PMI_RANK") is None or environ.get("PMI_SIZE") is None:
        return None
    name = "PMI (MPICH)"
    rank, size = _int(environ, "PMI_RANK", name), _int(environ, "PMI_SIZE", name)
    local_rank = _int(environ, "MPI_LOCALRANKID", name)
    local_size = _int(environ, "MPI_LOCALNRANKS", name)
    _check(name, rank, size, local_rank, local_size)
    multi = None if local_size is None else local_size < size
    return Job(PMI, rank, size, local_rank, local_size, None, None,
               _mpi_key(environ, ppid, "pmi"), multi, None)


def _pmix(environ, ppid):
    if environ.get("PMIX_RANK") is None:
        return None
    name = "PMIx"
    rank = _int(environ, "PMIX_RANK", name)
    size = _int(environ, "PMIX_SIZE", name)
    if size is None:
        size = _int(environ, "OMPI_COMM_WORLD_SIZE", name)
    if size is None:
        raise JobEnvError("PMIx: PMIX_RANK=%d is set but the job's size is not "
                          "(PMIX_SIZE or OMPI_COMM_WORLD_SIZE); start the job with a "
                          "launcher that sets it, or give TF_CONFIG." % rank)
    local_rank = _int(environ, "PMIX_LOCAL_RANK", name)
    local_size = _int(environ, "PMIX_LOCAL_SIZE", name)
    _check(name, rank, size, local_rank, local_size)
    multi = None if local_size is None else local_size < size
    return Job(PMIX, rank, size, local_rank, local_size, None, None,
               _mpi_key(environ, ppid, "pmix"), multi, None)


# -- Slurm's hostlist syntax --------------------------------------------------------------

def _split_top(text, sep=","):
    """``text`` split at ``sep`` outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise JobEnvError("hostlist %r: unbalanced ']'." % text)
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise JobEnvError("hostlist %r: unbalanced '['." % text)
    parts.append("".join(cur))
    return parts


def _expand_range(text, whole):
    out = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            raise JobEnvError("hostlist %r: an empty range in [%s]." % (whole, text))
        lo, _, hi = piece.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise JobEnvError("hostlist %r: %r is not a number or a range." % (whole, piece))
        if not hi:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise JobEnvError("hostlist %r: range %r runs backwards." % (whole, piece))
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        out.extend("%0*d" % (width, i) for i in range(a, b + 1))
    return out


def _expand_one(name, whole):
    m = re.search(r"\[([^\[\]]*)\]", name)
    if m is None:
        if "[" in name or "]" in name:
            raise JobEnvError("hostlist %r: unbalanced brackets in %r." % (whole, name))
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    return [head + value + rest for value in _expand_range(m.group(1), whole)
            for rest in _expand_one(tail, whole)]


def expand_hostlist(text):
    """Slurm's hostlist syntax expanded in order: ``"node[01-03,07],gpu[1-2]-ib"`` is
    ``node01 node02 node03 node07 gpu1-ib gpu2-ib`` (zero padding kept; several bracket
    groups in one name give their product)."""
    hosts = []
    for name in _split_top(text.strip()):
        name = name.strip()
        if not name:
            continue
        hosts.extend(_expand_one(name, text))
    return hosts


def expand_tasks_per_node(text):
    """Slurm's tasks per node (``SLURM_TASKS_PER_NODE``): ``"2(x3),1"`` is [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        m = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", part)
        if m is None:
            raise JobEnvError("SLURM_TASKS_PER_NODE %r: cannot read %r." % (text, part))
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def describe(job):
    """One line for the log: where the job came from and this task's place in it."""
    if job.source == TF_CONFIG:
        return "TF_CONFIG"
    names = {SLURM: "Slurm", OPEN_MPI: "Open MPI", PMI: "PMI (MPICH)", PMIX: "PMIx"}
    text = "%s: task %d of %d" % (names[job.source], job.rank, job.size)
    if job.local_rank is not None:
        text += ", local rank %d" % job.local_rank
    if job.host:
        text += " on %s" % job.host
    return text + " (job %s)" % job.key
