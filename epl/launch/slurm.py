"""``epl-launch --slurm``: the job's workers as one Slurm job step, restarted as new steps.

    epl-launch --slurm --num_workers 8 --gpu_per_worker 1 --max_restarts 3 run.sh

Inside an allocation (a batch script, ``salloc``) every attempt is a new step of it;
outside one, ``srun`` asks Slurm for an allocation per attempt.  Each attempt runs

    srun --kill-on-bad-exit=1 --label --ntasks=N [--srun_args ...] <the script>

so Slurm starts, places and stops the tasks (and kills the step when one task fails),
and the tasks meet as under any ``srun`` (``epl.core.rendezvous``: files on one node or
in ``EPL_RENDEZVOUS_DIR``, else the TCP meeting point).  What Slurm does not do the
launcher does, as on one machine:

* the restart rule is ``epl.launch.restart``'s (``RestartPolicy``, ``run_attempts``): a
  failed step is logged with its root cause and a new step starts, whose program resumes
  from its newest checkpoint (``EPL_RESTART_COUNT`` is the attempt).  Slurm's own
  ``sbatch --requeue`` restarts the whole batch job instead (docs/cluster.md); both may be
  used together.  Workers are never dropped (--min_workers): Slurm's task count is the
  step's;
* every task keeps what ``epl-launch`` gives a worker: ``EPL_WORKER_INDEX`` (its rank),
  ``EPL_LAUNCH_NUM_WORKERS``, ``EPL_CLUSTER_DEVICES_PER_WORKER`` (--gpu_per_worker) and
  one ``EPL_JOB_SECRET`` for all attempts (generated unless exported: it also
  authenticates the TCP meeting point);
* the output is split by task (``srun --label``) into ``worker_<i>.log`` and shown
  prefixed ``[worker i]``; srun's own lines go to ``srun.log`` too.  The failed task is
  the first that srun reports (``srun: error: <host>: task <i>: <what>``), so the summary
  names its rank and host, with its exception line and the end of its log.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from epl.core import worker_files as wf
from epl.launch.processes import dies_with_parent
from epl.launch.restart import RestartPolicy, failure, run_attempts
from epl.launch.signals import GRACE_SECONDS, INTERRUPTS, JobSignals, reason_of
from epl.launch.triage import exception_line, tail
from epl.launch.workers import command, job_secret

# srun's report of failed tasks: "srun: error: node02: task 5: Killed",
# "srun: error: node01: tasks 0-1,3: Exited with exit code 1".
SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
LABELLED = re.compile(r"^\s*(\d+): ?(.*)$", re.S)   # a task's line under srun --label
STEP = re.compile(r"\(job (slurm-\d+\.\d+)\)")    # EPL's "the job comes from Slurm" line
# (leaves the environment of the launcher: a step gets its own from the meeting)
_NOT_PASSED = ("TF_CONFIG", wf.COMM_ADDRESSES_ENV, wf.RUN_ID_ENV, wf.WORKER_INDEX_ENV,
               wf.LAUNCH_DIR_ENV, wf.JOB_ID_ENV)
# Every task's rank as EPL_WORKER_INDEX, as epl-launch gives it (programs read it before
# epl.init), then the program itself.
_TASK_SHIM = ["bash", "-c", 'export %s="$SLURM_PROCID"; exec "$@"' % wf.WORKER_INDEX_ENV,
              "epl-task"]


def check_args(a, error):
    """The flags --slurm cannot take (``error``: the parser's)."""
    if a.machine_list:
        error("--slurm: Slurm places the tasks; leave out --machine_list")
    if a.min_workers < a.num_workers:
        error("--slurm: a step's task count is fixed; --min_workers cannot drop workers")
    if shutil.which("srun") is None:
        error("--slurm: srun is not on PATH (install Slurm's client, or load its module)")


def srun_command(a):
    return (["srun", "--kill-on-bad-exit=1", "--label", "--ntasks=%d" % a.num_workers]
            + shlex.split(a.srun_args) + _TASK_SHIM + command(a))


def step_env(a, secret, number):
    """The environment srun passes to every task of attempt ``number``."""
    env = dict((k, v) for k, v in os.environ.items() if k not in _NOT_PASSED)
    env[wf.RESTART_COUNT_ENV] = str(number)
    env[wf.LAUNCH_NUM_WORKERS_ENV] = str(a.num_workers)
    env[wf.DEVICES_PER_WORKER_ENV] = str(a.gpu_per_worker)
    env[wf.JOB_SECRET_ENV] = secret
    env["PYTHONUNBUFFERED"] = "1"
    # `python` in a task's shell script is the interpreter epl-launch runs in.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def failed_tasks(lines):
    """[(rank, host, what)] of srun's error lines, in the order srun reported them."""
    out = []
    for line in lines:
        m = SRUN_ERROR.match(line.strip())
        if m:
            for part in m.group(2).split(","):
                lo, _, hi = part.partition("-")
                for rank in range(int(lo), int(hi or lo) + 1):
                    out.append((rank, m.group(1), m.group(3).strip()))
    return out


def root_cause(failed):
    """The failed task to name: the first srun reported, unless a later one failed by
    itself (killed, or an error of its own) while the first was only stopped by srun."""
    stopped_by_srun = ("Terminated", "Killed")
    for rank, host, what in failed:
        if what not in stopped_by_srun or not any(
                w not in stopped_by_srun for _, _, w in failed):
            return rank, host, what
    return failed[0]


class Step(object):
    """One attempt: the srun process, its output split into per-task logs."""

    def __init__(self, a, number, secret):
        self.a, self.number = a, number
        self.srun_lines, self.key = [], None
        self.logs = {}
        self.start = time.time()
        self.proc = subprocess.Popen(
            dies_with_parent(srun_command(a), GRACE_SECONDS - 1), env=step_env(a, secret, number),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.srun_log = open(os.path.join(a.log_dir, "srun.log"), "a")
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def log_path(self, rank):
        return os.path.join(self.a.log_dir, "worker_%d.log" % rank)

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            m = LABELLED.match(line)
            if m:
                rank, text = int(m.group(1)), m.group(2)
                if rank not in self.logs:
                    self.logs[rank] = open(self.log_path(rank), "w")
                self.logs[rank].write(text)
                self.logs[rank].flush()
                found = STEP.search(text)
                if found and self.key is None:
                    self.key = found.group(1)
                sys.stdout.write("[worker %d] %s" % (rank, text))
            else:
                self.srun_lines.append(line.rstrip("\n"))
                self.srun_log.write(line)
                self.srun_log.flush()
                sys.stdout.write(line)
            sys.stdout.flush()
        for f in self.logs.values():
            f.close()
        self.srun_log.close()

    def wait(self, timeout):
        """srun's exit status; None when ``timeout`` (seconds from the job's start, 0:
        none) passed first."""
        while self.proc.poll() is None:
            if timeout and time.time() > timeout:
                return None
            time.sleep(0.1)
        self.pump.join(10)
        return self.proc.returncode

    def stop(self):
        """SIGTERM to srun (it stops the step's tasks), SIGKILL after the grace period."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.pump.join(10)


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except OSError:
        pass   # (already gone)


class SlurmAttempts(object):
    """The runner of ``restart.run_attempts`` under Slurm: one srun step an attempt."""

    def __init__(self, a, secret):
        self.a, self.secret = a, secret
        self.start = time.time()
        self.step, self.cause, self.code, self.history = None, None, None, []

    def run_attempt(self, number, workers, note):
        if note:
            print("\n" + note, flush=True)
        print("epl-launch: attempt %d: srun step of %d task(s)" % (number, self.a.num_workers),
              flush=True)
        step = self.step = Step(self.a, number, self.secret)
        deadline = self.start + self.a.timeout if self.a.timeout else 0
        self.code = step.wait(deadline)
        ran = time.time() - step.start
        if self.code is None:
            step.stop()
            self.cause = None
            self.history.append((number, step.key, self.describe()))
            return failure(number, ran, final=True, what="epl-launch: " + self.describe())
        if self.code == 0:
            self.history.append((number, step.key, "succeeded"))
            return None
        failed = failed_tasks(step.srun_lines)
        self.cause = root_cause(failed) if failed else None
        self.history.append((number, step.key, self.describe()))
        return failure(number, ran, self.cause[0] if self.cause else None,
                       what="epl-launch: attempt %d (%s): %s after %.1f s; srun stopped the "
                            "other tasks.%s" % (number, step.key or "step", self.describe(),
                                                ran, self._exception()))

    def describe(self):
        """How the last attempt failed: the task srun named first, else srun's status."""
        if self.code is None:
            return "still running after --timeout %gs; stopped the step" % self.a.timeout
        if self.cause is None:
            srun = [l for l in self.step.srun_lines if l.startswith("srun: error")]
            return "srun exited with status %s%s" % (
                self.code, (" (%s)" % srun[-1]) if srun else "")
        rank, host, what = self.cause
        return "task %d on %s failed (srun: %s)" % (rank, host, what)

    def _exception(self):
        if self.cause is None:
            return ""
        line = exception_line(self.step.log_path(self.cause[0]))
        return "\n  " + line if line else ""

    def restarting(self, failed):
        lines = []
        for rank in sorted(self.step.logs):
            kept = os.path.join(self.a.log_dir,
                                "worker_%d.attempt%d.log" % (rank, self.step.number))
            try:
                os.replace(self.step.log_path(rank), kept)
            except OSError:
                continue
            if self.cause and rank == self.cause[0]:
                lines.append("  its log: %s" % kept)
        return lines

    def wait_for_machines(self, gone):
        return [], ""   # (Slurm places the tasks)

    def summary(self, reason):
        print("\nepl-launch summary (Slurm):")
        for number, key, how in self.history:
            print("  attempt %d: %s: %s" % (number, key or "step", how))
        if self.step is not None:
            for rank in sorted(self.step.logs):
                print("  worker %d: log %s" % (rank, self.step.log_path(rank)))
        if reason is None:
            return ""
        text = "epl-launch: %s." % self.describe() + self._exception()
        if self.cause is not None:
            path = self.step.log_path(self.cause[0])
            text += "\nLast lines of %s:\n%s" % (path, tail(path))
        return text + ("\n" + reason if reason else "")


def main(a):
    """Run the job under Slurm; the launcher's exit status."""
    secret = job_secret(a)
    os.makedirs(a.log_dir, exist_ok=True)
    print("epl-launch --slurm: %d task(s) x %d device(s)%s; %s" % (
        a.num_workers, a.gpu_per_worker,
        ", up to %d restart(s)" % a.max_restarts if a.max_restarts else "",
        "steps of allocation %s" % os.environ["SLURM_JOB_ID"] if os.environ.get("SLURM_JOB_ID")
        else "srun allocates each attempt"), flush=True)
    runner = SlurmAttempts(a, secret)
    message = ""
    with JobSignals() as signals:
        try:
            outcome = run_attempts(RestartPolicy.of(a), runner, list(range(a.num_workers)))
            message = runner.summary(outcome.reason if outcome.code else None)
        except INTERRUPTS as e:
            signals.hold()
            if runner.step is not None:
                runner.step.stop()
            runner.summary(None)
            message = "epl-launch: %s; stopped the step." % reason_of(e)
    if message:
        print("\n" + message, flush=True)
    return 1 if message else 0
