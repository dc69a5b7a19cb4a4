"""Rendezvous without a launcher: the tasks a cluster manager started (``srun``,
``mpirun``) find each other's addresses and make the job's TF_CONFIG themselves.

``establish()`` runs once per process, from ``epl.init`` before the cluster is made:

1. ``job_env.discover`` names the job (TF_CONFIG, Open MPI, Slurm, PMI, PMIx) and logs
   the source; TF_CONFIG or no manager: nothing more to do.
2. Each task binds two free ports (TensorFlow's server and EPL's collectives) and writes
   ``rank_<r>.json`` (host, ports, pid; rank 0 adds the job's secret) into the job's
   rendezvous folder, then waits for every rank's file; after
   ``EPL_RENDEZVOUS_TIMEOUT`` seconds (default 300) it raises naming the missing ranks.
   The folder is keyed by the job (Slurm: ``SLURM_JOB_ID.SLURM_STEP_ID``; MPI: its
   namespace / job id, else the launcher's pid), so two jobs or steps never meet.  One
   node: ``$EPL_RENDEZVOUS_DIR`` or ``/tmp/epl-rendezvous-<uid>/<key>``.  Several nodes
   meet in ``$EPL_RENDEZVOUS_DIR`` when it is set (a folder every node sees); without it
   they meet over TCP (``epl.core.rendezvous_tcp``: the first task of the first node
   listens on a port derived from the job's key), because a folder that only looks
   shared (the submit folder on the login node) would leave the tasks waiting until the
   timeout.  ``EPL_RENDEZVOUS=file`` or ``tcp`` chooses explicitly (``file`` on several
   nodes without the variable: Slurm's submit folder's ``.epl-rendezvous/<key>``).
3. The environment ``epl-launch`` would have given the task is set in ``os.environ``:
   TF_CONFIG, ``EPL_COMM_ADDRESSES``, ``EPL_JOB_ID``, ``EPL_RUN_ID``, ``EPL_JOB_SECRET``
   (rank 0's, unless the task has one);
   and on GPUs without ``CUDA_VISIBLE_DEVICES`` (Slurm's GRES sets it), the local rank's
   own GPUs.  Everything after reads them as under ``epl-launch``.
"""
import atexit
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import time

from epl.core import job_env
from epl.core import rendezvous_tcp
from epl.core import worker_files as wf
from epl.core.rendezvous_tcp import RendezvousError  # noqa: F401 (this module's error)

log = logging.getLogger("epl")

DIR_ENV = "EPL_RENDEZVOUS_DIR"
METHOD_ENV = "EPL_RENDEZVOUS"   # "file" or "tcp"; unset: chosen by ``method_for``
FILE, TCP = "file", "tcp"
TIMEOUT_ENV = "EPL_RENDEZVOUS_TIMEOUT"
HOST_ENV = "EPL_TASK_HOST"
DEFAULT_TIMEOUT = 300.0
_done = []   # the (job, source line) of this process, once established


def method_for(job, environ):
    """How the tasks of ``job`` meet: FILE or TCP (see the module's docstring)."""
    chosen = environ.get(METHOD_ENV, "").strip().lower()
    if chosen in (FILE, TCP):
        return chosen
    if chosen:
        raise RendezvousError("%s=%r: give %r or %r (or leave it unset)."
                              % (METHOD_ENV, environ[METHOD_ENV], FILE, TCP))
    return TCP if job.multi_node and not environ.get(DIR_ENV) else FILE


def folder_for(job, environ, uid=None):
    """The rendezvous folder of ``job``."""
    base = environ.get(DIR_ENV)
    if base:
        return os.path.join(base, job.key)
    if job.multi_node:
        submit = environ.get("SLURM_SUBMIT_DIR") if job.source == job_env.SLURM else None
        if submit:
            return os.path.join(submit, ".epl-rendezvous", job.key)
        raise RendezvousError(
            "%s: the job's tasks are on several nodes; EPL's tasks meet through files in a "
            "folder every node sees: export %s=<a folder on a shared file system>, or meet "
            "over TCP (%s=tcp), or give each task a TF_CONFIG." % (
                job_env.describe(job), DIR_ENV, METHOD_ENV))
    uid = os.getuid() if uid is None else uid
    return os.path.join("/tmp", "epl-rendezvous-%d" % uid, job.key)


def free_port(host="", held=None):
    """A port free now.  ``held``: a list the bound socket is kept in (the caller closes
    it), so that no other bind on this host, another task's of the same job included,
    is given the port until then; without it the port is free again at once, and tasks
    meeting on one node drew the same port (seen in CI: a task's server and another's
    collectives on one port)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        port = s.getsockname()[1]
    except BaseException:
        s.close()
        raise
    if held is None:
        s.close()
    else:
        held.append(s)
    return port


def _release(held):
    for s in held:
        s.close()
    del held[:]


def _write(path, record):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.rename(tmp, path)   # readers see the whole record or none


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True   # (another user's process: alive)


def own_record(job, host, extra=None, held=None):
    """What this task tells the others: where it listens (two free ports: TensorFlow's
    server, EPL's collectives; ``held``: their sockets, kept bound until the meeting is
    over, ``free_port``), its pid and node (a stale record is told by them) and, from
    rank 0, a fresh job secret for the job's TCP collectives."""
    record = {"host": host, "tf_port": free_port(held=held),
              "comm_port": free_port(held=held),
              "pid": os.getpid(), "node": socket.gethostname()}
    if job.rank == 0:
        record["secret"] = secrets.token_hex(16)
    record.update(extra or {})
    return record


def exchange_tcp(job, environ, host, timeout):
    """The records of every rank, met at the job's TCP meeting point."""
    where, port = rendezvous_tcp.address(job, environ)
    secret = environ.get(wf.JOB_SECRET_ENV) or None
    if secret is None:
        log.warning("EPL: the tasks meet over TCP without %s: the meeting is not "
                    "authenticated and the job's secret travels in the clear; export the "
                    "same random %s on every task.", wf.JOB_SECRET_ENV, wf.JOB_SECRET_ENV)
    held = []       # (every task's ports stay bound until all have drawn theirs)
    try:
        record = own_record(job, host, held=held)
        what = job_env.describe(job)
        timeout_env = "%s seconds, default %d" % (TIMEOUT_ENV, DEFAULT_TIMEOUT)
        if rendezvous_tcp.serves(job):
            return rendezvous_tcp.serve(job, port, record, timeout, secret, what,
                                        timeout_env, host=where)
        return rendezvous_tcp.join(job, where, port, record, timeout, secret, what,
                                   timeout_env)
    finally:
        _release(held)


def exchange(job, folder, host, timeout, poll=0.05, record_extra=None):
    """Write this task's record into ``folder`` and wait for every rank's; returns the
    records in rank order.  A record of this node whose process is gone (a stale file of
    an earlier job with the same key) counts as missing."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    held = []       # (every task's ports stay bound until all have drawn theirs)
    try:
        return _exchange(job, folder, own_record(job, host, record_extra, held), timeout, poll)
    finally:
        _release(held)


def _exchange(job, folder, record, timeout, poll):
    mine = os.path.join(folder, "rank_%d.json" % job.rank)
    _write(mine, record)
    atexit.register(_remove, mine, folder)
    deadline = time.time() + timeout
    records = [None] * job.size
    while True:
        for r in range(job.size):
            if records[r] is None:
                got = _read(os.path.join(folder, "rank_%d.json" % r))
                if got is not None and not (got.get("node") == record["node"]
                                            and not _alive(got.get("pid", 0))):
                    records[r] = got
        missing = [r for r, got in enumerate(records) if got is None]
        if not missing:
            return records
        if time.time() > deadline:
            raise RendezvousError(
                "%s: rank(s) %s did not reach the rendezvous in %s within %.0f s (%s "
                "seconds, %s); is every task running `epl.init()`?"
                % (job_env.describe(job), ", ".join(map(str, missing)), folder, timeout,
                   TIMEOUT_ENV, "default %d" % DEFAULT_TIMEOUT))
        time.sleep(poll)


def _remove(path, folder):
    try:
        os.remove(path)
        os.rmdir(folder)   # the last task's removal leaves no folder
    except OSError:
        pass


def job_environment(job, records):
    """The variables epl-launch would have given this task, from every rank's record."""
    addrs = ["%s:%d" % (r["host"], r["tf_port"]) for r in records]
    comm = ["%s:%d" % (r["host"], r["comm_port"]) for r in records]
    job_id = hashlib.sha1(job.key.encode()).hexdigest()[:12]
    return {
        "TF_CONFIG": json.dumps({"cluster": {"worker": addrs},
                                 "task": {"type": "worker", "index": job.rank}}),
        wf.COMM_ADDRESSES_ENV: ",".join(comm),
        wf.JOB_ID_ENV: job_id,
        wf.RUN_ID_ENV: hashlib.sha256((job.key + records[0]["secret"]).encode()
                                      ).hexdigest()[:12],
        wf.JOB_SECRET_ENV: records[0]["secret"],
    }


def local_gpus(job, environ, devices_per_worker, device_type):
    """CUDA_VISIBLE_DEVICES for this task, or None to leave it: set already (Slurm's GRES),
    a CPU job, or no local rank known.  ``devices_per_worker`` GPUs per task (0: one)."""
    if "CUDA_VISIBLE_DEVICES" in environ or device_type == "cpu" or job.local_rank is None:
        return None
    n = max(devices_per_worker, 1)
    first = job.local_rank * n
    return ",".join(str(first + g) for g in range(n))


def task_host(job, environ):
    """The address the other tasks reach this one at.  One node: loopback.  Several:
    ``EPL_TASK_HOST`` when set; else under Slurm this node's address on the route to the
    node that ran ``srun`` (``SLURM_LAUNCH_NODE_IPADDR``: a node name may resolve to
    127.0.1.1 on Debian); else the node's name."""
    if not job.multi_node:
        return "127.0.0.1"
    if environ.get(HOST_ENV):
        return environ[HOST_ENV]
    launch = environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if launch:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((launch, 9))   # (UDP: nothing is sent; the kernel picks the route)
            mine = s.getsockname()[0]
            if not mine.startswith("127."):
                return mine
        except OSError:
            pass
        finally:
            s.close()
    return job.host or socket.gethostname()


def establish(config, environ=None):
    """Find this process's job and, under a manager, meet its other tasks (once per
    process).  Returns the job (None: alone) after setting ``environ``."""
    if _done:
        return _done[0]
    job = meet(config, os.environ if environ is None else environ)
    _done.append(job)
    return job


def meet(config, environ):
    """``establish`` without its once-per-process memory: the job of ``environ``, which
    is updated when the tasks met."""
    job = job_env.discover(environ, ppid=os.getppid())
    if job is None or job.source == job_env.TF_CONFIG:
        if job is not None:
            log.info("EPL: the job is described by TF_CONFIG.")
        return job
    tcp = method_for(job, environ) == TCP
    where = ("over TCP at %s:%d" % rendezvous_tcp.address(job, environ) if tcp
             else "in %s" % folder_for(job, environ))
    print("EPL: the job comes from %s; meeting its other tasks %s." % (
        job_env.describe(job), where), file=sys.stderr)
    sys.stderr.flush()
    timeout = float(environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    if tcp:
        records = exchange_tcp(job, environ, task_host(job, environ), timeout)
    else:
        records = exchange(job, folder_for(job, environ), task_host(job, environ), timeout)
    found = job_environment(job, records)
    if environ.get(wf.JOB_SECRET_ENV):
        del found[wf.JOB_SECRET_ENV]   # the user's own (the same on every task) stays
    environ.update(found)
    gpus = local_gpus(job, environ, config.get("cluster.devices_per_worker"),
                      config.get("cluster.device_type"))
    if gpus is not None:
        environ["CUDA_VISIBLE_DEVICES"] = gpus
    log.info("EPL: %d tasks met; this is worker %d.", job.size, job.rank)
    return job
