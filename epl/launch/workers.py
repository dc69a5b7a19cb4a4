"""The worker processes of one attempt: what each is told, starting them, pumping their
output, watching them, stopping them.

An attempt (``Attempt``) is one start of the workers this machine runs: each gets its
environment (``worker_env``: TF_CONFIG and the names of ``epl.core.worker_files``), runs
under a supervisor that ends it with the launcher (``epl.launch.processes``), and has its
output copied to its log and, prefixed by its launch index, to the console.  ``watch``
waits for the attempt's end: a worker that failed (the root cause among those that did,
``epl.launch.triage``), a worker that left before it joined while another joined, or
--timeout; ``end_attempt`` stops what still runs and removes the attempt's leftovers.
"""
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from epl.core import worker_files as wf
from epl.launch import triage
from epl.launch.launch_dirs import remove_attempt_leftovers
from epl.launch.ports import machine_table, worker_addresses
from epl.launch.processes import dies_with_parent
from epl.launch.signals import GRACE_SECONDS, HeldSignals

# Printed when an attempt starts: its number (EPL_RESTART_COUNT) and run (EPL_RUN_ID).
RUN_LINE = "epl-launch: attempt %d: run %s"


def have_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=10)
        return out.returncode == 0 and b"GPU" in out.stdout
    except (OSError, subprocess.SubprocessError):
        return False


def job_secret(a):
    """The secret the workers' TCP collectives prove to each other."""
    given = os.environ.get(wf.JOB_SECRET_ENV, "")
    if given:
        return given
    if a.machine_list:
        raise SystemExit(
            "epl-launch --machine_list: the workers on different machines authenticate each "
            "other with a shared secret; export the same random EPL_JOB_SECRET on every "
            "machine first, e.g.  export EPL_JOB_SECRET=$(python -c 'import secrets; "
            "print(secrets.token_hex(16))')")
    return secrets.token_hex(16)


def job_id_of(addrs):
    """The id (EPL_JOB_ID) of a --machine_list job: every machine's launcher derives the
    same one from the list (a test harness that cleans up after a launch imports it)."""
    return hashlib.sha1(",".join(addrs).encode()).hexdigest()[:12]


def shared_run_id(job_id, secret, attempt):
    """The run id (EPL_RUN_ID: what its shared memory is named from) of attempt
    ``attempt`` of a --machine_list job.  The launchers of several machines derive the
    same one from what they share (workers on one host meet in shared memory); a reused
    secret gives reused names, which is safe: a segment whose owner died is never used.
    On one machine every attempt gets a random one instead."""
    return hashlib.sha256(("%s%s%d" % (job_id, secret, attempt)).encode()).hexdigest()[:12]


def worker_env(a, addrs, comm, index, job_id, gpus, local_index=None, run_id="",
               secret="", launch_dir="", restarts=0):
    """The environment of worker ``index`` (its rank), the ``local_index``-th of this
    machine (its GPUs), in the job's attempt number ``restarts`` (0: the first start)."""
    env = dict(os.environ)
    env[wf.RESTART_COUNT_ENV] = str(restarts)
    env[wf.LAUNCH_NUM_WORKERS_ENV] = str(a.num_workers)
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addrs},
                                   "task": {"type": "worker", "index": index}})
    env[wf.JOB_ID_ENV] = job_id
    env[wf.RUN_ID_ENV] = run_id
    if secret:
        env[wf.JOB_SECRET_ENV] = secret
    env[wf.COMM_ADDRESSES_ENV] = ",".join(comm)
    env[wf.WORKER_INDEX_ENV] = str(index)
    env[wf.DEVICES_PER_WORKER_ENV] = str(a.gpu_per_worker)
    if launch_dir:
        env[wf.LAUNCH_DIR_ENV] = launch_dir
    env["PYTHONUNBUFFERED"] = "1"
    # `python` in a worker's shell script is the interpreter epl-launch runs in.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if gpus:
        # GPUs are numbered per machine: this machine's k-th worker gets GPUs k*n .. k*n+n-1.
        local = index if local_index is None else local_index
        first = local * a.gpu_per_worker
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + g) for g in range(a.gpu_per_worker))
    return env


def command(a):
    if a.script.endswith(".py"):
        return [sys.executable, a.script] + a.args
    return ["bash", a.script] + a.args


class Worker(object):
    """One worker process of one attempt.  ``index``: the worker's number at launch (its
    log and console prefix keep it across restarts); ``rank``: its index in this attempt's
    TF_CONFIG (smaller once workers were dropped)."""

    def __init__(self, index, proc, log_path, rank=None):
        self.index = index
        self.rank = index if rank is None else rank
        self.proc = proc
        self.log_path = log_path
        self.pump = None


def _pump(worker, log_file):
    prefix = "[worker %d] " % worker.index
    for raw in iter(worker.proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace")
        log_file.write(line)
        log_file.flush()
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
    log_file.close()


def stop(workers):
    """SIGTERM every running worker's process group, then SIGKILL after a grace period."""
    running = [w for w in workers if w.proc.poll() is None]
    for w in running:
        try:
            os.killpg(w.proc.pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.time() + GRACE_SECONDS
    for w in running:
        try:
            w.proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            w.proc.wait()


def left_before_joining(workers, launch_dir):
    """(a worker that exited 0 before it joined the job, the running workers that joined
    and so wait for it), or None: see epl.launch.cli's docstring."""
    left = [w for w in workers if w.proc.returncode == 0 and not wf.joined(launch_dir, w.rank)]
    if not left:
        return None
    waiting = [w for w in workers if w.proc.poll() is None and wf.joined(launch_dir, w.rank)]
    return (left[0], waiting) if waiting else None


class Attempt(object):
    """One start of the job's workers: attempt ``number`` (EPL_RESTART_COUNT), its run
    (EPL_RUN_ID: its shared memory), its launch folder (join marks) and its workers."""

    def __init__(self, number, run_id, launch_dir):
        self.number = number
        self.run_id = run_id
        self.launch_dir = launch_dir
        self.workers = []
        self.start = time.time()
        self.ended = False
        self.cause_joined = False   # whether the root-cause worker had joined the job

    def seconds(self):
        return time.time() - self.start


def announce_attempt(attempt, display):
    """The line (and --log_json record) that names an attempt's run: what a tool or test
    parses to find the attempt's shared memory, /dev/shm/epl-<run>-*."""
    print(RUN_LINE % (attempt.number, attempt.run_id), flush=True)
    display.log({"type": "attempt", "attempt": attempt.number, "run_id": attempt.run_id,
                 "time": time.time()})


def start_attempt(a, attempt, workers, job_id, secret, gpus):
    """Start this machine's workers of ``attempt``.  ``workers``: the launch indices of the
    job's workers that take part (every machine's), in rank order.  A worker keeps its
    GPUs across restarts: those of its launch index (its index on its machine)."""
    addrs, comm, mine = worker_addresses(a, workers)
    per = machine_table(a)[1] if a.machine_list else a.num_workers
    for index in mine:
        rank = list(workers).index(index)
        log_path = os.path.join(a.log_dir, "worker_%d.log" % index)
        env = worker_env(a, addrs, comm, rank, job_id, gpus,
                         index % per, attempt.run_id, secret,
                         attempt.launch_dir, attempt.number)
        proc = subprocess.Popen(dies_with_parent(command(a), GRACE_SECONDS - 1), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        w = Worker(index, proc, log_path, rank)
        w.pump = threading.Thread(target=_pump, args=(w, open(log_path, "w")), daemon=True)
        w.pump.start()
        attempt.workers.append(w)


def watch(a, attempt, job_start, display=None):
    """Wait for the attempt's end: (root-cause worker or None, reason or None when every
    worker succeeded, whether a restart cannot help: --timeout)."""
    while True:
        ended = poll_attempt(a, attempt, job_start)
        if ended is not None:
            return ended
        if display is not None:
            display.poll()   # the workers' progress lines
        time.sleep(0.1)


def poll_attempt(a, attempt, job_start):
    """``watch``'s answer if the attempt has ended, else None."""
    workers = attempt.workers
    codes = [w.proc.poll() for w in workers]
    bad = [w for w, c in zip(workers, codes) if c not in (None, 0)]
    if bad:
        time.sleep(0.3)   # the peers of a failed worker fail within moments:
        bad = [w for w in workers if w.proc.poll() not in (None, 0)]   # see them all
        failed = triage.root_cause(
            bad, lambda w: triage.facts_of(w.proc.returncode, w.log_path))
        return failed, triage.describe_exit(failed.proc.returncode), False
    if all(c == 0 for c in codes):
        return None, None, False
    early = left_before_joining(workers, attempt.launch_dir)
    if early:
        return early[0], (
            "exited with status 0 before it joined the job's collectives (it never ran "
            "the job's graph), while worker%s %s joined and would wait for it in them "
            "(every worker of a job runs its steps: look for what ended worker %d's "
            "script early)" % ("s" if len(early[1]) > 1 else "",
                               ", ".join(str(w.index) for w in early[1]), early[0].index)
        ), False
    if a.timeout and time.time() - job_start > a.timeout:
        failed = next(w for w, c in zip(workers, codes) if c is None)
        return failed, "still running after --timeout %gs" % a.timeout, True
    return None


def end_attempt(attempt, failed, reason):
    """Stop what still runs (when the attempt failed), collect the logs, remove the run's
    shared memory and launch folder.  Idempotent."""
    if attempt is None or attempt.ended:
        return
    attempt.ended = True
    with HeldSignals():   # (a Ctrl-C now must not cut the stop short)
        try:
            if failed is not None:
                attempt.cause_joined = wf.joined(attempt.launch_dir, failed.rank)
            if reason:
                stop(attempt.workers)
            for w in attempt.workers:
                w.pump.join(5)
        finally:
            remove_attempt_leftovers(attempt.run_id, attempt.launch_dir)


def finish_attempt(attempt, display, failed, reason):
    """``end_attempt``, after the display read the attempt's last progress samples (the
    launch folder that holds them goes with the attempt)."""
    if attempt is not None and not attempt.ended:
        display.poll(final=True)
    end_attempt(attempt, failed, reason)


def keep_log(a, w, number):
    """Move a failed attempt's log aside (worker_<i>.attempt<k>.log): the next attempt
    writes worker_<i>.log again."""
    kept = os.path.join(a.log_dir, "worker_%d.attempt%d.log" % (w.index, number))
    try:
        os.replace(w.log_path, kept)
    except OSError:
        return w.log_path
    w.log_path = kept
    return kept
