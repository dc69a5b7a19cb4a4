"""The one way benchmarks run child processes: every run ends within its bound and leaves
no process behind.

A benchmark measures in fresh processes (a cold start, or the ranks of a cross-process
collective).  Those children can hang -- a rank of TensorFlow's collective ops waits
forever for a peer that left, and nothing cancels it -- and they can outlive the
benchmark (a rank holding gigabytes kept running after its caller was killed).  So:

* each child runs in its own process group (``start_new_session``), and whatever it
  starts stays in that group: the group is what gets killed;
* a run has an overall deadline; past it the run fails and its groups are killed;
* the children of one run are peers: one that exits non-zero, or exits 0 *without its
  result* (``has_result``), fails the run at once -- its peers would wait for it
  forever -- and the others' groups are killed;
* when the run ends, however it ends, every child's group is killed (SIGTERM, then
  SIGKILL after ``GRACE_SECONDS``), so grandchildren left behind go too;
* if the caller ends first -- SIGTERM, Ctrl-C (SIGINT), a normal exit -- the live groups
  are killed; if the caller is killed outright (SIGKILL), each child's supervisor
  (``epl.launch.processes.dies_with_parent``) sees its parent gone and kills the child's whole
  process tree.

    outcome = run_group([cmd_rank0, cmd_rank1], timeout=600, has_result=json_result)
    if not outcome.ok: print(outcome.failure)
    text = run_one(cmd, timeout=600)        # raises Failed
"""
import atexit
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import threading
import time

GRACE_SECONDS = 3
POLL_SECONDS = 0.05


def _load_epl_processes():
    """EPL's epl/launch/processes.py (the trampoline that makes a child die with its caller, which
    epl-launch uses for its workers), loaded by its path: ``import epl.launch.processes`` would
    import the epl package, and with it TensorFlow, into every benchmark's parent process
    (seconds and hundreds of MB that only the children need), and would need the
    repository's root on sys.path."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "epl", "launch", "processes.py")
    spec = importlib.util.spec_from_file_location("_epl_processes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_processes = _load_epl_processes()

_live = set()            # Popen objects whose group may still have processes
_live_lock = threading.Lock()
_installed = []


class Failed(RuntimeError):
    """A benchmark's child run failed (the message says which child and how)."""


class Outcome(object):
    """How one run ended: ``ok``, ``failure`` (what went wrong, or None), each child's
    ``outputs`` (stdout text, '' when not captured), exit ``codes`` (None: killed by the
    watchdog while running) and ``pids``."""

    def __init__(self, failure, outputs, codes, pids):
        self.failure = failure
        self.ok = failure is None
        self.outputs = outputs
        self.codes = codes
        self.pids = pids


def json_result(output):
    """The JSON value on the last non-empty line of ``output``, or None."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return None


def has_json_result(output):
    return json_result(output) is not None


def prefixed_result(prefix):
    """has_result for children that print '<prefix><json>' (e.g. 'RESULT {...}')."""
    def check(output):
        return any(ln.startswith(prefix) for ln in output.splitlines())
    return check


def kill_group(proc, grace=GRACE_SECONDS):
    """SIGTERM to the child's process group, SIGKILL to what is left after ``grace``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        pass
    if proc.poll() is None:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # (members that outlived the leader too)
    except OSError:
        pass
    if proc.poll() is None:
        proc.wait()
    with _live_lock:
        _live.discard(proc)


def kill_all():
    """Kill every live group (the caller is ending)."""
    with _live_lock:
        procs = list(_live)
    for p in procs:
        kill_group(p, grace=1)


def _on_signal(signum, frame):
    kill_all()
    previous = _installed[0].get(signum) if _installed else None
    if callable(previous):
        previous(signum, frame)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers():
    """Once per process: kill the live groups at exit and on SIGTERM / SIGINT."""
    if _installed:
        return
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)
            if prev is signal.default_int_handler:
                prev = None   # (re-raised as KeyboardInterrupt by _on_signal)
            previous[sig] = prev
            signal.signal(sig, _on_signal)
    _installed.append(previous)
    atexit.register(kill_all)


def _start(cmd, env, cwd, capture):
    _install_handlers()
    # (die with the caller: the supervisor of epl.launch.processes.dies_with_parent)
    proc = subprocess.Popen(_processes.dies_with_parent(cmd), env=env, cwd=cwd,
                            start_new_session=True, stdout=subprocess.PIPE if capture else None)
    with _live_lock:
        _live.add(proc)
    chunks = []
    reader = None
    if capture:
        def read():
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                chunks.append(chunk)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    return proc, chunks, reader


def run_group(cmds, timeout, env=None, cwd=None, has_result=None, capture=True,
              names=None, peer_seconds=None):
    """Run the commands of one run together (peers, e.g. the ranks of a collective) and
    wait for them, at most ``timeout`` seconds.  ``has_result(output)`` (or
    ``has_result(index, output)`` when it takes two arguments) says whether a child that
    exited 0 produced its result; without it, exit status 0 is success.  With
    ``peer_seconds``, once one child has finished with its result the others must finish
    within that time (ranks that ran the same collectives end together).  Returns an
    Outcome; every child's process group is gone when it returns."""
    names = names or ["child %d" % i for i in range(len(cmds))]
    started = [_start(c, env, cwd, capture) for c in cmds]
    procs = [s[0] for s in started]
    deadline = time.time() + timeout
    failure = None

    def output(i):
        return b"".join(started[i][1]).decode("utf-8", "replace")

    def produced(i):
        if has_result is None:
            return True
        reader = started[i][2]
        if reader is not None:
            reader.join(5)   # (the rest of its output)
        if len(inspect.signature(has_result).parameters) >= 2:
            return has_result(i, output(i))
        return has_result(output(i))

    judged = set()
    first_done = None   # (time, name) of the first child that finished with its result
    try:
        while True:
            for i, p in enumerate(procs):
                code = p.poll()
                if code is None or i in judged:
                    continue
                judged.add(i)
                if code != 0:
                    failure = "%s exited with status %d" % (names[i], code)
                elif not produced(i):
                    failure = "%s exited with status 0 without a result" % names[i]
                elif first_done is None:
                    first_done = (time.time(), names[i])
                if failure:
                    break
            if failure or len(judged) == len(procs):
                break
            now = time.time()
            running = [names[i] for i, p in enumerate(procs) if p.poll() is None]
            if now > deadline:
                failure = "no result within %gs (%s still running)" % (timeout,
                                                                     ", ".join(running))
                break
            if peer_seconds is not None and first_done and now - first_done[0] > peer_seconds:
                failure = "%s still running %gs after %s finished" % (
                    ", ".join(running), peer_seconds, first_done[1])
                break
            time.sleep(POLL_SECONDS)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    for _, _, reader in started:
        if reader is not None:
            reader.join(5)
    if failure and any(c is None for c in codes):
        failure += "; stopped the others"
    return Outcome(failure, [output(i) for i in range(len(procs))], codes,
                   [p.pid for p in procs])


def run_one(cmd, timeout, env=None, cwd=None, has_result=None, capture=True, name=None):
    """Run one child; its stdout (when captured).  Raises Failed with its tail."""
    if name is None:
        scripts = [c for c in cmd if str(c).endswith(".py")]
        name = os.path.basename(str(scripts[0] if scripts else cmd[0]))
    out = run_group([cmd], timeout, env=env, cwd=cwd, has_result=has_result,
                    capture=capture, names=[name])
    if not out.ok:
        raise Failed("%s%s" % (out.failure, ("; its output ended:\n" + out.outputs[0][-2000:])
                                if out.outputs[0] else ""))
    return out.outputs[0]
