"""Ctrl-C and SIGTERM in epl-launch: they end the job (never restarted), and while the
launcher stops the workers and prints its summary they cannot cut that short.

One place for both launch paths (one machine, and a machine of a --machine_list job):
``JobSignals`` turns the first SIGTERM into ``Terminated`` (as Ctrl-C raises
KeyboardInterrupt), ``hold()`` then turns further ones into a printed line, and leaving it
restores the handlers found.
"""
import os
import signal
import threading

# Seconds between the SIGTERM that stops a worker and the SIGKILL that follows.
GRACE_SECONDS = 10


class Terminated(Exception):
    """SIGTERM reached the launcher."""


INTERRUPTS = (KeyboardInterrupt, Terminated)


def reason_of(interrupt):
    """The line that names how the job was interrupted."""
    return ("interrupted (Ctrl-C)" if isinstance(interrupt, KeyboardInterrupt)
            else "terminated (SIGTERM)")


def _on_sigterm(signum, frame):
    """The first SIGTERM stops the job like Ctrl-C; later ones (while stopping) are ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


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


def _main_thread():
    return threading.current_thread() is threading.main_thread()


class HeldSignals(object):
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
        if (self.saved is None and _main_thread()
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


class JobSignals(object):
    """For the whole of a job: SIGTERM raises ``Terminated``; ``hold()`` (when the job is
    stopping) holds Ctrl-C and SIGTERM as ``HeldSignals`` does; on exit every handler is
    restored."""

    def __init__(self):
        self.held = HeldSignals()
        self.previous = None

    def __enter__(self):
        if _main_thread():
            self.previous = signal.signal(signal.SIGTERM, _on_sigterm)
        return self

    def hold(self):
        self.held.hold()

    def __exit__(self, *exc):
        self.held.release()
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
