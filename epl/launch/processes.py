"""Child processes that end with the process that started them, however it ends.

epl-launch starts its workers, and benchmarks/watchdog.py its benchmark runs, each in a
session of its own (``start_new_session``), so that the whole group can be stopped; but
then nothing stops them when their parent is killed outright (SIGKILL) -- a worker or a
rank holding gigabytes (or GPUs) would run on alone.

``dies_with_parent(cmd)`` is the command line that runs ``cmd`` under a small supervisor
process (``supervise``), Python's standard library only:

    caller --(session, process group G)--> supervisor --(same group G)--> cmd --> ...

Why a supervisor, and why this one:

* Linux's parent-death signal (PR_SET_PDEATHSIG) alone is not enough: it is set on one
  process and cleared in the children it forks.  A worker command that is a shell script
  (or ``python -m`` behind a wrapper) starts the real program as a child, and that child
  lived on with parent 1 when the launcher was killed (measured, issue 33).  Whatever
  ``cmd`` is, something that outlives the caller's SIGKILL must end the whole job.
* The supervisor notices its caller's death by polling ``getppid()`` (10 times a
  second): it changes when the caller process dies, by any signal.  PDEATHSIG fires when
  the *thread* that started the child exits, which would kill the workers of a launcher
  that starts them from a short-lived thread; a pipe's end of file needs the caller to
  pass the pipe (every caller's Popen call would change).  Polling needs neither.
* Then it SIGKILLs every descendant: its process group and, because it is a child
  subreaper (PR_SET_CHILD_SUBREAPER), also those that left the group (``setsid``, a
  daemonizing wrapper) -- orphans are reparented to it, not to init, so the walk of
  the process tree from the supervisor finds them all.
* It stays in ``cmd``'s process group, so the caller's ``killpg`` (SIGTERM, then
  SIGKILL) reaches the supervisor and the job at once, as before.  Stop signals it gets
  (SIGTERM, SIGINT, SIGHUP) are passed on to the descendants outside the group (the
  group got them already); with ``grace``, descendants still alive that many seconds
  after the first one are SIGKILLed, before a caller's own SIGKILL of the group would
  leave the ones outside the group orphaned.
* When ``cmd``'s own process ends, whatever it left behind is SIGKILLed (a job's
  processes end with it: a background process would also keep the caller's output pipe
  open), and the supervisor ends the way ``cmd`` ended: the same exit status, or the
  same signal, so the caller's triage ("was killed by SIGSEGV") is unchanged.

This module uses the standard library only and imports nothing from EPL:
benchmarks/watchdog.py loads it by its path, so that a benchmark's parent process does
not import EPL (and TensorFlow) just to start its children; the supervisor loads it the
same way, in an isolated interpreter (``-I``: no user folder on ``sys.path`` can shadow
a standard module).
"""
import os
import signal
import sys
import time

# Runs in the child (argv: this file, the caller's pid, grace or "-", then the program).
_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_epl_supervisor', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module.supervise(int(sys.argv[2]), sys.argv[4:],\n"
    "                 None if sys.argv[3] == '-' else float(sys.argv[3]))\n")

POLL_SECONDS = 0.1
# Exit status of a supervisor whose caller was gone before the program could start.
CALLER_GONE = 70
_PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def dies_with_parent(cmd, grace=None):
    """``cmd`` (a list: program and arguments) started under a supervisor that ends it,
    and everything it starts, when this process ends, however this one ends (see the
    module's docstring).  ``grace``: seconds after a stop signal (SIGTERM, SIGINT,
    SIGHUP) to the supervisor after which what still runs is SIGKILLed."""
    return [sys.executable, "-I", "-c", _BOOT, os.path.abspath(__file__), str(os.getpid()),
            "-" if grace is None else repr(float(grace))] + list(cmd)


def _parents():
    """{pid: parent pid} of every process (from /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                table[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass   # (it ended meanwhile)
    return table


def descendants(pid=None):
    """The pids of every process below ``pid`` (default: this one) in the process tree."""
    pid = os.getpid() if pid is None else pid
    children = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _reap():
    """Reap every child that ended; {pid: wait status}."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status


def _kill_everything(keep=None):
    """SIGKILL every descendant until none is left (one forked meanwhile is found by the
    next walk; an orphan comes back to this subreaper).  Returns the reaped statuses."""
    ended = {}
    deadline = time.time() + 30
    while time.time() < deadline:
        ended.update(_reap())
        below = descendants()
        if not below:
            break
        _signal_all(below, signal.SIGKILL)
        time.sleep(0.01)
    ended.update(_reap())
    return ended


def _end_like(status):
    """End this process as a process with wait status ``status`` ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # (its core, not ours)
        except (ImportError, ValueError, OSError):
            pass
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)   # pylint: disable=protected-access
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    os._exit(code)   # pylint: disable=protected-access


def supervise(caller, cmd, grace=None):
    """The supervisor's main: run ``cmd`` until it ends or ``caller`` does (see the
    module's docstring).  Never returns."""
    import subprocess
    if os.getppid() != caller:
        os._exit(CALLER_GONE)   # pylint: disable=protected-access
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # pylint: disable=broad-except
        pass   # (not Linux: the process group still goes)
    received = []
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        worker = subprocess.Popen(cmd)
    except OSError as e:
        print("epl: cannot start %s: %s" % (cmd[0], e), file=sys.stderr, flush=True)
        os._exit(127)   # pylint: disable=protected-access
    group, kill_at, ended = os.getpgid(0), None, {}
    while True:
        ended.update(_reap())
        if worker.pid in ended:
            break
        if os.getppid() != caller:   # the caller is gone, however it ended
            _kill_everything()
            os._exit(CALLER_GONE)   # pylint: disable=protected-access
        while received:
            sig = received.pop(0)
            outside = []
            for pid in descendants():
                try:
                    if os.getpgid(pid) != group:
                        outside.append(pid)
                except OSError:
                    pass
            _signal_all(outside, sig)
            if grace is not None and kill_at is None:
                kill_at = time.time() + grace
        if kill_at is not None and time.time() >= kill_at:
            break   # (the grace is over: everything is killed below)
        time.sleep(POLL_SECONDS)
    ended.update(_kill_everything())   # what it left behind (or all of it, after grace)
    _end_like(ended.get(worker.pid, int(signal.SIGKILL)))
