"""Child processes that end with the process that started them, however it ends.

epl-launch starts its workers, and benchmarks/watchdog.py its benchmark runs, each in a
session of its own (``start_new_session``), so that the whole group can be stopped; but
then nothing stops them when their parent is killed outright (SIGKILL) -- a worker or a
rank holding gigabytes would run on alone.  ``dies_with_parent(cmd)`` is the command line
that runs ``cmd`` behind a short trampoline: Linux's PR_SET_PDEATHSIG sends the child
SIGKILL when its parent dies, and a child whose parent is already gone by the time the
trampoline runs does not start its program at all.

This module uses the standard library only and imports nothing from EPL:
benchmarks/watchdog.py loads it by its path, so that a benchmark's parent process does
not import EPL (and TensorFlow) just to start its children.
"""
import os
import sys

# Runs in the child before its program (argv: the parent's pid, then the program).
_DIE_WITH_PARENT = (
    "import os, signal, sys\n"
    "try:\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dies_with_parent(cmd):
    """``cmd`` (a list: program and arguments) started so that it ends when this process
    does, however this one ends; the trampoline ``exec``s it, so the child keeps its pid."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid())] + list(cmd)
