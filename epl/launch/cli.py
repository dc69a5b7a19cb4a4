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
launcher under the same rule (epl.launch.coordinator; a worker that fails again at start-up
is dropped there too), and a machine whose launcher stays away longer than --host_timeout
is dropped the same way.  With --machine_list each machine's launcher shows the progress
of its own workers (epl.launch.display).

This module is the command line (``parse_args``, ``main``) and the one-machine runner of
the attempts; the rest of the package has one job a module: ``ports``, ``launch_dirs``,
``workers`` (processes, logs, stop), ``triage`` (the root cause), ``restart`` (the policy
and the attempt loop), ``signals``, ``channel`` and ``coordinator`` (several machines),
``slurm`` (--slurm: the workers as Slurm job steps).
"""
import argparse
import os
import secrets
import sys
import time

from epl.core.worker_files import JOB_ID_ENV
from epl.launch.coordinator import follow_coordinator
from epl.launch.display import ProgressDisplay
from epl.launch.launch_dirs import new_launch_dir, sweep_launch_dirs
from epl.launch.ports import worker_addresses
from epl.launch import slurm
from epl.launch.restart import RestartPolicy, failure, print_summary, run_attempts
from epl.launch.signals import INTERRUPTS, JobSignals, reason_of
from epl.launch.triage import exception_line, tail
from epl.launch.workers import (Attempt, announce_attempt, finish_attempt, have_gpus,
                                job_id_of, job_secret, keep_log, shared_run_id, start_attempt,
                                watch)

# --restart_window's default: an hour of running before a failure resets the restart count.
DEFAULT_RESTART_WINDOW = 3600
DEFAULT_HOST_TIMEOUT = 120


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
    p.add_argument("--slurm", action="store_true",
                   help="run the workers as a Slurm job step (srun --kill-on-bad-exit), in "
                        "the allocation it runs in (else srun allocates one); --max_restarts "
                        "starts a new step after a failed one (docs/cluster.md, Slurm)")
    p.add_argument("--srun_args", default="",
                   help="--slurm: more srun options, e.g. \"--nodes=2 --gpus-per-task=1\"")
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
    if a.slurm:
        slurm.check_args(a, p.error)
    elif a.srun_args:
        p.error("--srun_args is for --slurm")
    return a


class LocalAttempts(object):
    """The runner of ``restart.run_attempts`` on one machine (and of the one attempt of a
    --machine_list job without --max_restarts): it starts and watches the workers itself."""

    def __init__(self, a, job_id, secret, gpus, display):
        self.a, self.job_id, self.secret, self.gpus = a, job_id, secret, gpus
        self.display = display
        self.attempt, self.failed, self.reason = None, None, None
        self.start = time.time()

    def run_attempt(self, number, workers, note):
        if note:
            print("\n" + note, flush=True)
        # This attempt's id (shared memory is named from it): new for every attempt on one
        # machine; with --machine_list (one attempt here) shared_run_id's.
        run_id = (shared_run_id(self.job_id, self.secret, number) if self.a.machine_list
                  else secrets.token_hex(6))
        attempt = self.attempt = Attempt(number, run_id, new_launch_dir(run_id))
        announce_attempt(attempt, self.display)
        start_attempt(self.a, attempt, workers, self.job_id, self.secret, self.gpus)
        # (the workers' progress files are named by their rank in this attempt)
        self.display.follow(attempt.launch_dir, [w.rank for w in attempt.workers])
        failed, self.reason, final = watch(self.a, attempt, self.start, self.display)
        self.failed = failed
        finish_attempt(attempt, self.display, failed, self.reason)
        if self.reason is None:
            return None
        ran = attempt.seconds()
        cause = exception_line(failed.log_path)
        return failure(number, ran, failed.index, attempt.cause_joined, final,
                       "epl-launch: attempt %d: worker %d %s after %.1f s; stopped the others.%s"
                       % (number, failed.index, self.reason, ran,
                          "\n  " + cause if cause else ""))

    def restarting(self, failed):
        lines = []
        for w in self.attempt.workers:
            path = keep_log(self.a, w, self.attempt.number)
            if w is self.failed:
                lines.append("  its log: %s" % path)
        return lines

    def wait_for_machines(self, gone):
        return [], ""   # (no other machine here)

    def message(self, reason):
        """How the job ended, for the summary: the root cause and its log's last lines."""
        w = self.failed
        cause = exception_line(w.log_path)
        text = ("epl-launch: worker %d %s; stopped the others.%s\nLast lines of %s:\n%s"
                % (w.index, self.reason, "\n  " + cause if cause else "", w.log_path,
                   tail(w.log_path)))
        return text + ("\n" + reason if reason else "")


def main(argv=None):
    a = parse_args(argv)
    if a.slurm:
        return slurm.main(a)
    addrs, comm, mine = worker_addresses(a)
    job_id = os.environ.get(JOB_ID_ENV) or (
        job_id_of(addrs) if a.machine_list else job_id_of(addrs + [str(time.time())]))
    secret = job_secret(a)
    os.makedirs(a.log_dir, exist_ok=True)
    sweep_launch_dirs()
    gpus = have_gpus()
    print("epl-launch: %d worker(s) x %d %s device(s), job %s, this machine starts %s"
          % (a.num_workers, a.gpu_per_worker, "GPU" if gpus else "virtual CPU", job_id, mine),
          flush=True)
    if a.max_restarts:
        print("epl-launch: up to %d restart(s) (the count resets after %g s of running)%s"
              % (a.max_restarts, a.restart_window,
                 ", down to %d worker(s)" % a.min_workers if a.min_workers < a.num_workers
                 else ""), flush=True)
    if a.machine_list and a.max_restarts:
        return follow_coordinator(a, job_id, secret, gpus)
    display = ProgressDisplay(None, [], log_json=a.log_json)
    runner = LocalAttempts(a, job_id, secret, gpus, display)
    message = ""
    with JobSignals() as signals:
        try:
            outcome = run_attempts(RestartPolicy.of(a), runner, list(range(a.num_workers)))
            if outcome.code:
                message = runner.message(outcome.reason)
        except INTERRUPTS as e:
            runner.failed, runner.reason = None, reason_of(e)
            message = "epl-launch: %s; stopped all workers." % runner.reason
        finally:
            signals.hold()   # (from here on a Ctrl-C does not cut the stop or the summary short)
            finish_attempt(runner.attempt, display, runner.failed, runner.reason or "stopped")
        print_summary("epl-launch summary", runner.attempt, display, a.log_dir, message)
        return 1 if message else 0


if __name__ == "__main__":
    sys.exit(main())
