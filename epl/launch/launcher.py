"""epl-launch: start the workers of a job with their TF_CONFIG, and watch them.

    epl-launch --num_workers 2 --gpu_per_worker 1 run.sh [ARGS]

Every worker's output goes to its own log file and, prefixed by its rank, to the
console.  When a worker exits non-zero (or on Ctrl-C, or after --timeout) the
launcher stops the others by PID (SIGTERM, then SIGKILL), names the worker whose
failure came first -- the root cause, not the peers that failed because of it --
with its exception line and the tail of its log, and exits non-zero.  On a machine
without GPUs each worker gets --gpu_per_worker virtual CPU devices.

A worker that exits with status 0 is done, and the job goes on while the others finish
(a chief still writing its last checkpoint, say) -- unless it left before it joined the
job: a worker joins when it first runs a session on the graph EPL rewrote for the job,
which is where it meets the others' collectives (it writes worker_<i>.joined into the
launch's folder, EPL_LAUNCH_DIR; an in-graph worker that only serves its devices never
joins, and exits after the chief).  A worker that exits 0 without having joined while
another worker has joined and still runs is premature: that one waits for it in its first
collective (for communication.timeout_seconds), so the launcher stops the job at once and
names the worker that left.  Once a worker has joined, EPL's collectives themselves fail
at once, naming it, in any peer that still needs it after it exits.

Every launch is a new run (EPL_RUN_ID, printed as "epl-launch: attempt K: run ID" when its
workers start): its shared-memory segments, /dev/shm/epl-ID-*, are its own, and
the launcher removes them when the job ends, however it ends (Ctrl-C and SIGTERM stop the
workers too; a launcher killed outright takes its workers, and whatever they started,
with it: each worker runs under a supervisor, epl.launch.processes).  The workers' TCP
collectives authenticate each other with the job's secret (EPL_JOB_SECRET): a random
one per launch on one machine; with --machine_list, export the same random value on
every machine before launching.

Restarts (--max_restarts N): a failed attempt -- a worker exits non-zero
or dies, or leaves before joining -- is stopped as above and logged with its root cause,
and every worker starts again as a new run (new EPL_RUN_ID, new free ports, the old run's
shared memory removed, the old logs kept as worker_<i>.attempt<k>.log; EPL_RESTART_COUNT
is the attempt).  The program resumes from its newest checkpoint.  An attempt that ran
--restart_window seconds resets the count; after N restarts the job fails as above.  With
--min_workers M, a worker that was the root cause and then fails again at start-up
(before it joined) is dropped while more than M remain: the others go on with a smaller
TF_CONFIG (see docs/cluster.md, "Restarts", for the batch and learning-rate rule).
With --machine_list, machine 0's launcher coordinates the restarts of every machine's
launcher (see "restarts across machines" below); a machine whose launcher stays away
longer than --host_timeout is dropped the same way.  With --machine_list each machine's
launcher shows the progress of its own workers (epl.launch.display).
"""
import argparse
import glob
import hashlib
import hmac
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from epl.core.worker_files import LAUNCH_DIR_ENV, joined, mark_joined  # noqa: F401 (re-exported)
from epl.launch.processes import dies_with_parent
from epl.launch.display import ProgressDisplay

GRACE_SECONDS = 10
# --restart_window's default: an hour of running before a failure resets the restart count.
DEFAULT_RESTART_WINDOW = 3600
DEFAULT_HOST_TIMEOUT = 120
# How many times epl-launch started the job's workers again before this attempt (0 first).
RESTART_COUNT_ENV = "EPL_RESTART_COUNT"
# Printed when an attempt starts: its number (EPL_RESTART_COUNT) and run (EPL_RUN_ID).
RUN_LINE = "epl-launch: attempt %d: run %s"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="epl-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--num_workers", type=int, required=True, help="workers in the job (all hosts)")
    p.add_argument("--gpu_per_worker", type=int, default=1,
                   help="devices per worker (virtual CPU devices where there is no GPU)")
    p.add_argument("--machine_list", default="",
                   help="comma-separated host:port of every machine (multi-host); worker i of "
                        "machine m listens on host_m:port_m+i")
    p.add_argument("--machine_rank", type=int, default=0, help="this machine's index in --machine_list")
    p.add_argument("--log_dir", default=os.environ.get("EPL_LOG_DIR") or "epl_logs",
                   help="where worker_<i>.log files go (default: $EPL_LOG_DIR, else epl_logs "
                        "in the current folder)")
    p.add_argument("--timeout", type=float, default=0, help="stop the job after S seconds (0: never)")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="when a worker fails, stop the others and start every worker again, "
                        "up to N times; training resumes from the job's newest checkpoint "
                        "(default 0: the job fails at the first failure)")
    p.add_argument("--restart_window", type=float, default=DEFAULT_RESTART_WINDOW,
                   help="an attempt that ran this many seconds before it failed resets the "
                        "count of restarts (default %d s)" % DEFAULT_RESTART_WINDOW)
    p.add_argument("--min_workers", type=int, default=0,
                   help="a worker that fails again at start-up after a restart is dropped and "
                        "the job goes on with the others, as long as at least M remain "
                        "(default: --num_workers, never drop)")
    p.add_argument("--host_timeout", type=float, default=DEFAULT_HOST_TIMEOUT,
                   help="--machine_list with --max_restarts: how long machine 0's launcher "
                        "waits for another machine's launcher to connect, at the start and "
                        "after it went away (default %d s); one that stays away is dropped "
                        "(--min_workers) or ends the job" % DEFAULT_HOST_TIMEOUT)
    p.add_argument("--log_json", default="",
                   help="also write the workers' progress samples and the end-of-job summary "
                        "to this file, as JSON lines (docs/profiling.md)")
    p.add_argument("script", help="the local training script (.sh or .py)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.num_workers < 1:
        p.error("--num_workers must be >= 1, got %d" % a.num_workers)
    if a.gpu_per_worker < 1:
        p.error("--gpu_per_worker must be >= 1, got %d" % a.gpu_per_worker)
    if not os.path.exists(a.script):
        p.error("script %r does not exist" % a.script)
    if a.max_restarts < 0:
        p.error("--max_restarts must be >= 0, got %d" % a.max_restarts)
    if a.restart_window <= 0:
        p.error("--restart_window must be > 0 seconds, got %g" % a.restart_window)
    if a.min_workers == 0:
        a.min_workers = a.num_workers
    if not 1 <= a.min_workers <= a.num_workers:
        p.error("--min_workers must be between 1 and --num_workers (%d), got %d"
                % (a.num_workers, a.min_workers))
    if a.min_workers < a.num_workers and not a.max_restarts:
        p.error("--min_workers %d: dropping a worker restarts the job on the others; give "
                "--max_restarts N (N >= 2: one restart after the failure, one after the "
                "worker fails again at start-up)" % a.min_workers)
    if a.host_timeout <= 0:
        p.error("--host_timeout must be > 0 seconds, got %g" % a.host_timeout)
    return a


def free_ports(n, host="127.0.0.1"):
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
    import random
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


def worker_addresses(a, taking_part=None):
    """(TF addresses of all workers, EPL communication addresses, ranks of the workers
    this machine starts).  ``taking_part``: the machines of this attempt (all of them
    unless some were dropped)."""
    if not a.machine_list:
        ports = free_ports(2 * a.num_workers)
        return (["127.0.0.1:%d" % p for p in ports[:a.num_workers]],
                ["127.0.0.1:%d" % p for p in ports[a.num_workers:]], list(range(a.num_workers)))
    table, per = machine_table(a)
    taking_part = list(range(len(table))) if taking_part is None else list(taking_part)
    addrs, comm = [], []
    for m in taking_part:
        host, port = table[m]
        # worker i of a machine: TF on port + i, EPL's collectives on port + per + i
        addrs += ["%s:%d" % (host, port + i) for i in range(per)]
        comm += ["%s:%d" % (host, port + per + i) for i in range(per)]
    first = taking_part.index(a.machine_rank) * per if a.machine_rank in taking_part else 0
    return addrs, comm, list(range(first, first + per))


def _have_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=10)
        return out.returncode == 0 and b"GPU" in out.stdout
    except (OSError, subprocess.SubprocessError):
        return False


def worker_env(a, addrs, comm, index, job_id, gpus, local_index=None, run_id="",
               secret="", launch_dir="", restarts=0):
    """The environment of worker ``index``, the ``local_index``-th this machine starts, in
    the job's attempt number ``restarts`` (0: the first start)."""
    env = dict(os.environ)
    env[RESTART_COUNT_ENV] = str(restarts)
    env["EPL_LAUNCH_NUM_WORKERS"] = str(a.num_workers)
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addrs},
                                   "task": {"type": "worker", "index": index}})
    env["EPL_JOB_ID"] = job_id
    env["EPL_RUN_ID"] = run_id
    if secret:
        env["EPL_JOB_SECRET"] = secret
    env["EPL_COMM_ADDRESSES"] = ",".join(comm)
    env["EPL_WORKER_INDEX"] = str(index)
    env["EPL_CLUSTER_DEVICES_PER_WORKER"] = str(a.gpu_per_worker)
    if launch_dir:
        env[LAUNCH_DIR_ENV] = launch_dir
    env["PYTHONUNBUFFERED"] = "1"
    # `python` in a worker's shell script is the interpreter epl-launch runs in.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if gpus:
        # GPUs are numbered per machine: this machine's k-th worker gets GPUs k*n .. k*n+n-1.
        local = index if local_index is None else local_index
        first = local * a.gpu_per_worker
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + g) for g in range(a.gpu_per_worker))
    return env


def job_secret(a):
    """The secret the workers' TCP collectives prove to each other."""
    given = os.environ.get("EPL_JOB_SECRET", "")
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


def announce_attempt(attempt, display):
    """The line (and --log_json record) that names an attempt's run: what a tool or test
    parses to find the attempt's shared memory, /dev/shm/epl-<run>-*."""
    print(RUN_LINE % (attempt.number, attempt.run_id), flush=True)
    display.log({"type": "attempt", "attempt": attempt.number, "run_id": attempt.run_id,
                 "time": time.time()})


def remove_segments(run_id):
    """Remove the shared memory a run left (a killed worker cannot unlink its own)."""
    removed = 0
    for path in glob.glob("/dev/shm/epl-%s-*" % run_id):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


LAUNCH_DIR_PREFIX = "epl-launch-"
_OWNER_FILE = "launcher.pid"


def new_launch_dir(run_id):
    """The launch folder of one attempt, marked with this launcher's pid so that a later
    launch can tell it from a live one's when this launcher is killed outright (SIGKILL
    leaves its folder behind)."""
    folder = tempfile.mkdtemp(prefix="%s%s-" % (LAUNCH_DIR_PREFIX, run_id))
    with open(os.path.join(folder, _OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return folder


def sweep_launch_dirs(root=None):
    """Remove the launch folders of launchers that are gone (killed before they could
    remove their own); a folder whose launcher still runs, or that has no owner mark, is
    kept.  Returns the folders removed."""
    removed = []
    for folder in glob.glob(os.path.join(root or tempfile.gettempdir(), LAUNCH_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(folder, _OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True     # (someone else's process: alive)
    return True


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


# Failure triage reads at most this much of the end of a worker's log: a log can be
# gigabytes (a job that printed for days), and its root cause is in its last lines.
TRIAGE_BYTES = 256 * 1024


def _last_lines(path, limit=TRIAGE_BYTES):
    """The lines of the last ``limit`` bytes of ``path`` (the first, cut, line dropped
    when the file is longer); [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines(True)
    return lines[1:] if size > limit and lines else lines


def tail(path, lines=20):
    return "".join(_last_lines(path)[-lines:])


_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)): ")
# What a worker reports when it fails because another worker did (not a root cause).
_CASCADE = ("reported:", "exited while rank", "disconnected while rank", "the job stopped")


def exception_line(path):
    """The last exception line in a worker's log ('SomeError: message'), or ''."""
    lines = [l.rstrip("\r\n") for l in _last_lines(path)]
    found = [i for i, l in enumerate(lines) if _EXCEPTION.match(l.strip())]
    if not found:
        return ""
    line = lines[found[-1]].strip()
    if line.endswith(": Graph execution error:"):   # TF 2.x: the message follows "Node: 'x'"
        node = [k for k in range(found[-1], len(lines)) if lines[k].startswith("Node: ")]
        if node and node[0] + 1 < len(lines):
            line = line[:-len("Graph execution error:")] + lines[node[0] + 1].strip()
    return line


def root_cause(failed):
    """The failure that came first: a worker killed by a signal, or whose error is its own
    (not a report of another worker's failure); else the first one seen."""
    def own(w):
        line = exception_line(w.log_path)
        return line and not any(c in line for c in _CASCADE)
    for pick in (lambda w: w.proc.returncode is not None and w.proc.returncode < 0, own):
        chosen = [w for w in failed if pick(w)]
        if chosen:
            return chosen[0]
    return failed[0]


def describe_exit(code):
    if code is not None and code < 0:
        try:
            return "was killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with status %s" % code


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
    """(a worker that exited 0 before it joined the job, a running worker that joined and
    so waits for it), or None: see the module's docstring."""
    left = [w for w in workers if w.proc.returncode == 0 and not joined(launch_dir, w.rank)]
    if not left:
        return None
    waiting = [w for w in workers if w.proc.poll() is None and joined(launch_dir, w.rank)]
    return (left[0], waiting) if waiting else None


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _on_sigterm(signum, frame):
    """The first SIGTERM stops the job like Ctrl-C; later ones (while stopping) are ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()


_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _note_signal(signum, frame):
    """Ctrl-C or SIGTERM while the launcher stops the job: say so, and go on stopping.
    (Written with os.write: a signal handler may run inside a print to the console.)"""
    what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    try:
        os.write(2, ("\nepl-launch: %s again: still stopping the workers (SIGTERM sent, "
                     "SIGKILL %d s after it at the latest); the summary follows.\n"
                     % (what, GRACE_SECONDS)).encode())
    except OSError:
        pass


class _HeldSignals(object):
    """While the launcher stops the workers and prints its summary, Ctrl-C and SIGTERM
    print a line instead of raising: a second Ctrl-C used to end the launcher with a
    traceback in the middle of ``stop``, before its SIGKILL of the workers that ignore
    SIGTERM and before the summary.  (The workers cannot outlive the launcher anyway:
    epl.launch.processes ends them when it dies, but then without the summary and root cause.)
    Nests; only in the main thread (the only one signals reach); ``release`` restores
    the handlers found at ``hold``."""

    def __init__(self):
        self.saved = None

    def hold(self):
        if (self.saved is None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not _note_signal):
            self.saved = [(sig, signal.getsignal(sig)) for sig in _HELD_SIGNALS]
            for sig in _HELD_SIGNALS:
                signal.signal(sig, _note_signal)
        return self

    def release(self):
        if self.saved is not None:
            for sig, handler in self.saved:
                signal.signal(sig, handler)
            self.saved = None

    def __enter__(self):
        return self.hold()

    def __exit__(self, *exc):
        self.release()


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


def start_attempt(a, attempt, slots, job_id, secret, gpus, machines=None):
    """Start the workers ``slots`` (their launch indices, in rank order) of ``attempt``.
    On one machine every attempt gets new free ports; with --machine_list the ports are
    the list's, over the ``machines`` that take part (every worker of this machine does)."""
    if a.machine_list:
        addrs, comm, ranks = worker_addresses(a, machines)
    else:
        ports = free_ports(2 * len(slots))
        addrs = ["127.0.0.1:%d" % p for p in ports[:len(slots)]]
        comm = ["127.0.0.1:%d" % p for p in ports[len(slots):]]
        ranks = list(range(len(slots)))
    for local, (index, rank) in enumerate(zip(slots, ranks)):
        log_path = os.path.join(a.log_dir, "worker_%d.log" % index)
        # (a worker keeps its GPUs across restarts: those of its launch index)
        env = worker_env(a, addrs, comm, rank, job_id, gpus,
                         local if a.machine_list else index, attempt.run_id, secret,
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
        failed = root_cause(bad)
        return failed, describe_exit(failed.proc.returncode), False
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
    with _HeldSignals():   # (a Ctrl-C now must not cut the stop short)
        try:
            if failed is not None:
                attempt.cause_joined = joined(attempt.launch_dir, failed.rank)
            if reason:
                stop(attempt.workers)
            for w in attempt.workers:
                w.pump.join(5)
        finally:
            remove_segments(attempt.run_id)
            shutil.rmtree(attempt.launch_dir, ignore_errors=True)


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


# -- restarts across machines ------------------------------------------------------------
#
# With --machine_list every machine runs its own epl-launch.  Under --max_restarts they
# must agree on every restart, so one of them decides: machine 0's launcher also runs a
# coordinator on machine 0's host, port + 2 * workers per machine.  Every launcher (machine
# 0's too) connects to it and proves the job's secret (HMAC-SHA256 over both sides'
# nonces, as the workers' TCP collectives do); then the coordinator says when an attempt
# starts and on which machines, and when to stop it; each launcher runs its own workers
# and reports how they ended.  A launcher whose connection drops (its host died, it was
# killed) is a failed machine: the coordinator waits --host_timeout for it to come back,
# then drops it (--min_workers) or ends the job.

HANDSHAKE_SECONDS = 5


def control_address(a):
    """(host, port) of the coordinator: machine 0's host, after its workers' ports."""
    table, per = machine_table(a)
    return table[0][0], table[0][1] + 2 * per


def _mac(secret, *parts):
    return hmac.new(secret.encode(), "|".join(str(p) for p in parts).encode(),
                    hashlib.sha256).hexdigest()


# A control link whose peer is silent this long (a partition, a machine that lost power:
# no FIN, no reset) counts as closed, so the coordinator's --host_timeout and the machines'
# "coordinator went away" apply to it too.  Kernel keepalive probes are answered by a live
# peer's kernel, however loaded its launcher is.
LINK_DEAD_SECONDS = 20


def _detect_silent_peer(sock, seconds):
    """Keepalive probes after seconds/4 of silence, every seconds/4, 3 unanswered: closed;
    unacknowledged data for ``seconds``: closed (TCP_USER_TIMEOUT).  Where the platform
    lacks an option, the kernel's default applies."""
    step = max(1, int(seconds // 4))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", step), ("TCP_KEEPINTVL", step), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(seconds * 1000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass   # (not supported here: the kernel's defaults)


class Channel(object):
    """JSON messages, one a line, over a TCP connection.  After the handshake a thread
    reads them into ``events`` as (tag, channel, message); message None: closed."""

    def __init__(self, sock):
        self.sock = sock
        _detect_silent_peer(sock, LINK_DEAD_SECONDS)
        self.reader = sock.makefile("rb")
        self.lock = threading.Lock()

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def receive(self, timeout):
        """One message, read now (the handshake)."""
        self.sock.settimeout(timeout)
        try:
            line = self.reader.readline()
        finally:
            self.sock.settimeout(None)
        if not line:
            raise OSError("the connection closed")
        message = json.loads(line.decode())
        if not isinstance(message, dict):
            raise ValueError("not a message")
        return message

    def read_into(self, events, tag):
        def read():
            try:
                for line in self.reader:
                    events.put((tag, self, json.loads(line.decode())))
            except (OSError, ValueError):
                pass
            events.put((tag, self, None))
        threading.Thread(target=read, daemon=True).start()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect_to_coordinator(a, job_id, secret, timeout):
    """This machine's authenticated channel to the coordinator (retried until
    ``timeout``: machine 0's launcher may start later)."""
    address = control_address(a)
    deadline = time.time() + timeout
    refused = False   # (a connection closed on this machine's proof: another secret)
    while True:
        answered = False
        try:
            ch = Channel(socket.create_connection(address, timeout=HANDSHAKE_SECONDS))
            ch.sock.settimeout(None)
            hello = ch.receive(HANDSHAKE_SECONDS)
            mine = secrets.token_hex(16)
            ch.send({"machine": a.machine_rank, "nonce": mine,
                     "mac": _mac(secret, "launcher", job_id, a.machine_rank, hello["nonce"],
                                 mine)})
            answered = True
            proof = ch.receive(HANDSHAKE_SECONDS)
            if not hmac.compare_digest(str(proof.get("mac")), _mac(
                    secret, "coordinator", job_id, a.machine_rank, hello["nonce"], mine)):
                raise SystemExit("epl-launch: the coordinator at %s:%d does not prove the "
                                 "job's secret (EPL_JOB_SECRET differs between the machines?)"
                                 % address)
            return ch
        except (OSError, ValueError, KeyError) as e:
            refused = refused or answered
            if time.time() > deadline:
                raise SystemExit(
                    "epl-launch: machine %d cannot reach machine 0's launcher at %s:%d "
                    "within --host_timeout %gs: %s" % ((a.machine_rank,) + address + (
                        timeout, "it closed the connection when it got this machine's proof "
                        "of the job's secret (is EPL_JOB_SECRET the same on every machine?)"
                        if refused else e)))
            time.sleep(0.5)


class _Abort(Exception):
    """A launcher was stopped by its user: the job ends."""


class Coordinator(object):
    """Machine 0's decisions for a --machine_list job with --max_restarts (see above)."""

    def __init__(self, a, job_id, secret):
        self.a, self.job_id, self.secret = a, job_id, secret
        table, self.per = machine_table(a)
        self.hosts = [h for h, _ in table]
        self.events = queue.Queue()
        self.channels = {}
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind(control_address(a))
        except OSError as e:
            raise SystemExit("epl-launch: machine 0 coordinates the restarts of a "
                             "--machine_list job on its port + 2 x workers per machine, "
                             "%s:%d, and cannot listen there: %s" % (control_address(a) + (e,)))
        self.listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True).start()

    def _handshake(self, sock, peer):
        ch = Channel(sock)
        try:
            nonce = secrets.token_hex(16)
            ch.send({"nonce": nonce})
            hello = ch.receive(HANDSHAKE_SECONDS)
            k = int(hello["machine"])
            if not 0 <= k < len(self.hosts) or not hmac.compare_digest(
                    str(hello["mac"]), _mac(self.secret, "launcher", self.job_id, k, nonce,
                                            hello["nonce"])):
                raise ValueError("it does not prove the job's secret")
            ch.send({"mac": _mac(self.secret, "coordinator", self.job_id, k, nonce,
                                 hello["nonce"])})
        except (OSError, ValueError, KeyError, TypeError) as e:
            print("epl-launch: the coordinator refused a connection from %s: %s"
                  % (peer[0], e), file=sys.stderr, flush=True)
            ch.close()
            return
        self.events.put((k, ch, {"type": "connected"}))
        ch.read_into(self.events, k)

    def _next(self, deadline):
        """The next message of a machine's current channel: (machine, message); a closed
        channel gives {"type": "gone"}; None at the deadline."""
        while True:
            try:
                k, ch, msg = self.events.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                return None
            if msg is not None and msg.get("type") == "connected":
                old, self.channels[k] = self.channels.get(k), ch
                if old is not None:
                    old.close()
                return k, msg
            if self.channels.get(k) is not ch:
                continue   # (a channel this machine replaced)
            if msg is None:
                del self.channels[k]
                return k, {"type": "gone"}
            if msg.get("type") == "abort":
                raise _Abort("machine %d's launcher was %s" % (k, msg.get("reason")))
            return k, msg

    def _wait_for(self, machines, timeout):
        """Wait until every machine of ``machines`` is connected; the missing ones."""
        deadline = time.time() + timeout
        while not set(machines) <= set(self.channels):
            if self._next(deadline) is None:
                break
        return sorted(set(machines) - set(self.channels))

    def _send_all(self, machines, message):
        for k in machines:
            if k in self.channels:
                self.channels[k].send(message)

    def describe(self, k, report):
        where = "machine %d (%s)" % (k, self.hosts[k])
        if report.get("type") == "gone":
            return where + ": its launcher went away (the host, or its epl-launch, is gone)"
        return "%s: worker %d %s%s" % (where, report["worker"], report["reason"],
                                      "\n  " + report["cause"] if report.get("cause") else "")

    def root_cause(self, reports):
        """The failure that came first, as the one-machine rule says: a killed worker, a
        machine gone, a worker's own error, else the first report."""
        for pick in (lambda r: r.get("killed"), lambda r: r.get("type") == "gone",
                     lambda r: r.get("own")):
            chosen = [(k, r) for k, r in reports if pick(r)]
            if chosen:
                return chosen[0]
        return reports[0]

    def _run(self):
        try:
            code, message = self._drive()
        except _Abort as e:
            code, message = 1, "epl-launch: %s; stopped all workers." % e
        except Exception as e:  # pylint: disable=broad-except
            code, message = 1, "epl-launch: the coordinator failed: %r" % e
        machines = sorted(self.channels, key=lambda k: k == 0)   # (machine 0's last)
        self._send_all(machines, {"type": "finish", "code": code, "message": message})
        self.listener.close()

    def _drive(self):
        a, alive = self.a, list(range(len(self.hosts)))
        missing = self._wait_for(alive, a.host_timeout)
        if missing:
            return 1, ("epl-launch: the launcher of machine(s) %s did not connect to machine "
                       "0's within --host_timeout %gs" % (missing, a.host_timeout))
        number, used, note = 0, 0, ""
        while True:
            start = time.time()
            run_id = shared_run_id(self.job_id, self.secret, number)
            self._send_all(alive, {"type": "start", "attempt": number, "machines": alive,
                                   "run_id": run_id, "note": note})
            reports, done = [], set()
            while not reports:   # the attempt runs
                event = self._next(time.time() + 3600)
                if event is None:
                    continue
                k, msg = event
                if msg["type"] == "connected" and k not in alive:
                    self.channels[k].send({"type": "finish", "code": 1, "message":
                                           "epl-launch: machine %d was dropped from the job"
                                           % k})
                elif msg["type"] == "done" and msg["attempt"] == number:
                    done.add(k)
                    if done >= set(alive):
                        return 0, ""
                elif msg["type"] == "failed" and msg["attempt"] == number:
                    reports.append((k, msg))
                elif msg["type"] == "gone" and k in alive:
                    reports.append((k, msg))
            ran = time.time() - start
            self._send_all(alive, {"type": "stop", "attempt": number})
            pending = set(k for k in alive if k in self.channels)
            deadline = time.time() + GRACE_SECONDS + 15
            while pending:   # every launcher stops its workers
                event = self._next(deadline)
                if event is None:
                    break
                k, msg = event
                if msg["type"] == "failed" and msg["attempt"] == number:
                    reports.append((k, msg))
                elif msg["type"] == "stopped" and msg["attempt"] == number:
                    pending.discard(k)
                elif msg["type"] == "gone" and k in alive:
                    pending.discard(k)
                    if all(r[0] != k for r in reports):
                        reports.append((k, msg))
            k, cause = self.root_cause(reports)
            what = "epl-launch: attempt %d failed after %.1f s: %s" % (
                number, ran, self.describe(k, cause))
            if cause.get("final"):
                return 1, what
            if ran >= a.restart_window:
                used = 0
            if used >= a.max_restarts:
                return 1, ("%s\nepl-launch: the job failed after %d restart(s): --max_restarts "
                           "%d (the count resets after %g s of running)"
                           % (what, number, a.max_restarts, a.restart_window))
            used += 1
            note = what
            gone = [k for k, r in reports if r.get("type") == "gone" and k in alive]
            for k in self._wait_for(gone, a.host_timeout):
                if (len(alive) - 1) * self.per < a.min_workers:
                    return 1, ("%s\nepl-launch: machine %d's launcher did not come back within "
                               "--host_timeout %gs, and without it fewer than --min_workers "
                               "%d workers remain" % (what, k, a.host_timeout, a.min_workers))
                alive.remove(k)
                note += ("\nepl-launch: machine %d (%s) did not come back within --host_timeout "
                         "%gs: dropped for good; the job goes on with %d worker(s) on machine(s) "
                         "%s (--min_workers %d). Every worker keeps its batch, so the global "
                         "batch is now %d of the %d workers' batches; input sliced by io.slicing "
                         "is re-sharded over the remaining workers."
                         % (k, self.hosts[k], a.host_timeout, len(alive) * self.per, alive,
                            a.min_workers, len(alive) * self.per, a.num_workers))
            number += 1
            note += ("\nepl-launch: restart %d of %d (EPL_RESTART_COUNT=%d): starting %d "
                     "worker(s) again; training resumes from the job's newest checkpoint"
                     % (used, a.max_restarts, number, len(alive) * self.per))


def report_of(a, attempt, failed, reason, final):
    """What this machine tells the coordinator about its attempt's end."""
    if reason is None:
        return {"type": "done", "attempt": attempt.number}
    line = exception_line(failed.log_path) if failed is not None else ""
    code = failed.proc.returncode if failed is not None else None
    return {"type": "failed", "attempt": attempt.number, "machine": a.machine_rank,
            "worker": failed.index if failed is not None else -1, "reason": reason,
            "cause": line, "killed": code is not None and code < 0,
            "own": bool(line) and not any(c in line for c in _CASCADE), "final": final}


def run_coordinated(a, job_id, secret, gpus, mine):
    """One machine's launcher of a --machine_list job with --max_restarts: attempts as
    the coordinator (machine 0's launcher) says.  It shows the progress of its own
    workers (their samples are files on this machine)."""
    coordinator = Coordinator(a, job_id, secret) if a.machine_rank == 0 else None
    ch = connect_to_coordinator(a, job_id, secret, a.host_timeout)
    events = queue.Queue()
    ch.read_into(events, None)
    attempt, reported, code, message = None, True, 1, ""
    job_start = time.time()
    display = ProgressDisplay(None, [], log_json=a.log_json)
    previous = (signal.signal(signal.SIGTERM, _on_sigterm)
                if threading.current_thread() is threading.main_thread() else None)
    held = _HeldSignals()
    try:
        try:
            while True:
                try:
                    msg = events.get(timeout=0.1)[2]
                except queue.Empty:
                    if attempt is not None and not reported:
                        ended = poll_attempt(a, attempt, job_start)
                        if ended is not None:
                            finish_attempt(attempt, display, ended[0], ended[1])
                            ch.send(report_of(a, attempt, *ended))
                            reported = True
                        else:
                            display.poll()   # this machine's workers' progress lines
                    continue
                if msg is None:
                    message = ("epl-launch: machine 0's launcher (the coordinator, %s:%d) went "
                               "away; stopped this machine's workers." % control_address(a))
                    break
                if msg["type"] == "start":
                    if msg.get("note"):
                        print("\n" + msg["note"], flush=True)
                    if attempt is not None:
                        for w in attempt.workers:
                            keep_log(a, w, attempt.number)
                    attempt = Attempt(msg["attempt"], msg["run_id"],
                                      new_launch_dir(msg["run_id"]))
                    announce_attempt(attempt, display)
                    start_attempt(a, attempt, mine, job_id, secret, gpus, msg["machines"])
                    display.follow(attempt.launch_dir, [w.rank for w in attempt.workers])
                    reported = False
                elif msg["type"] == "stop":
                    finish_attempt(attempt, display, None, "stopped by the coordinator")
                    if attempt is not None and not reported:
                        ch.send(report_of(a, attempt, None, "stopped", False))
                        reported = True
                    ch.send({"type": "stopped", "attempt": msg["attempt"]})
                elif msg["type"] == "finish":
                    code, message = msg["code"], msg["message"]
                    break
        except (KeyboardInterrupt, _Terminated) as e:
            reason = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else \
                "terminated (SIGTERM)"
            ch.send({"type": "abort", "reason": reason})
            message = "epl-launch: %s; stopped all workers." % reason
        finally:
            held.hold()   # (from here on a Ctrl-C does not cut the stop or the summary short)
            try:
                finish_attempt(attempt, display, None, "stopped")
            finally:
                if coordinator is not None:
                    coordinator.thread.join(GRACE_SECONDS + 20)
                ch.close()
        print("\nepl-launch summary (machine %d):" % a.machine_rank)
        for w in attempt.workers if attempt else []:
            print("  worker %d: %s  log %s" % (w.index, "exit %s" % w.proc.returncode, w.log_path))
        display.summary(dict((w.rank, w.proc.returncode) for w in attempt.workers)
                        if attempt else {})
        if message:
            print("\n" + message, flush=True)
        return code
    finally:
        held.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    a = parse_args(argv)
    addrs, comm, mine = worker_addresses(a)
    job_id = os.environ.get("EPL_JOB_ID") or (
        job_id_of(addrs) if a.machine_list else job_id_of(addrs + [str(time.time())]))
    secret = job_secret(a)
    os.makedirs(a.log_dir, exist_ok=True)
    sweep_launch_dirs()
    gpus = _have_gpus()
    print("epl-launch: %d worker(s) x %d %s device(s), job %s, this machine starts %s"
          % (a.num_workers, a.gpu_per_worker, "GPU" if gpus else "virtual CPU", job_id, mine),
          flush=True)
    if a.max_restarts:
        print("epl-launch: up to %d restart(s) (the count resets after %g s of running)%s"
              % (a.max_restarts, a.restart_window,
                 ", down to %d worker(s)" % a.min_workers if a.min_workers < a.num_workers
                 else ""), flush=True)
    if a.machine_list and a.max_restarts:
        return run_coordinated(a, job_id, secret, gpus, mine)
    slots = list(mine)        # the launch indices of the workers that take part
    used = 0                  # restarts counted against --max_restarts (the window resets it)
    last_cause = None         # the launch index of the previous attempt's root cause
    attempt, failed, reason, final, number = None, None, None, False, 0
    display = ProgressDisplay(None, [], log_json=a.log_json)
    job_start = time.time()
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    else:
        previous = None
    held = _HeldSignals()
    try:
        try:
            while True:
                # This attempt's id (shared memory is named from it): new for every attempt on
                # one machine; with --machine_list (one attempt here) shared_run_id's.
                run_id = (shared_run_id(job_id, secret, number) if a.machine_list
                          else secrets.token_hex(6))
                attempt = Attempt(number, run_id,
                                  new_launch_dir(run_id))
                announce_attempt(attempt, display)
                start_attempt(a, attempt, slots, job_id, secret, gpus)
                # (the workers' progress files are named by their rank in this attempt)
                display.follow(attempt.launch_dir, [w.rank for w in attempt.workers])
                failed, reason, final = watch(a, attempt, job_start, display)
                finish_attempt(attempt, display, failed, reason)
                if reason is None or final:
                    break
                ran = attempt.seconds()
                if ran >= a.restart_window:
                    used = 0
                if used >= a.max_restarts:
                    break
                used += 1
                cause = exception_line(failed.log_path)
                print("\nepl-launch: attempt %d: worker %d %s after %.1f s; stopped the others.%s"
                      % (number, failed.index, reason, ran, "\n  " + cause if cause else ""),
                      flush=True)
                drop = (failed.index == last_cause and not attempt.cause_joined
                        and len(slots) > a.min_workers)
                last_cause = failed.index
                for w in attempt.workers:
                    path = keep_log(a, w, number)
                    if w is failed:
                        print("  its log: %s" % path, flush=True)
                if drop:
                    slots.remove(failed.index)
                    print("epl-launch: worker %d failed again at start-up (before it joined "
                          "the job): dropped for good; the job goes on with %d worker(s) "
                          "(--min_workers %d): %s. Every worker keeps its batch, so the global "
                          "batch is now %d of the %d workers' batches; input sliced by "
                          "io.slicing is re-sharded over the remaining workers."
                          % (failed.index, len(slots), a.min_workers,
                             ", ".join("worker %d is rank %d" % (i, r)
                                       for r, i in enumerate(slots)),
                             len(slots), a.num_workers), flush=True)
                number += 1
                print("epl-launch: restart %d of %d (EPL_RESTART_COUNT=%d): starting %d worker(s) "
                      "again; training resumes from the job's newest checkpoint"
                      % (used, a.max_restarts, number, len(slots)), flush=True)
        except KeyboardInterrupt:
            failed, reason = None, "interrupted (Ctrl-C)"
        except _Terminated:
            failed, reason = None, "terminated (SIGTERM)"
        finally:
            held.hold()   # (from here on a Ctrl-C does not cut the stop or the summary short)
            finish_attempt(attempt, display, failed, reason or "stopped")
        print("\nepl-launch summary:")
        for w in attempt.workers if attempt else []:
            print("  worker %d: %s  log %s" % (w.index, "exit %s" % w.proc.returncode, w.log_path))
        display.summary(dict((w.rank, w.proc.returncode) for w in attempt.workers)
                        if attempt else {})
        if number:
            print("  %d restart(s); the logs of earlier attempts: worker_<i>.attempt<k>.log in %s"
                  % (number, a.log_dir))
        if reason:
            if failed is not None:
                cause = exception_line(failed.log_path)
                print("\nepl-launch: worker %d %s; stopped the others.%s\nLast lines of %s:\n%s"
                      % (failed.index, reason, "\n  " + cause if cause else "", failed.log_path,
                         tail(failed.log_path)))
                if a.max_restarts and not final:
                    print("epl-launch: the job failed after %d restart(s): --max_restarts %d "
                          "(the count resets after %g s of running)"
                          % (number, a.max_restarts, a.restart_window))
            else:
                print("\nepl-launch: %s; stopped all workers." % reason)
            return 1
        return 0
    finally:
        held.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
