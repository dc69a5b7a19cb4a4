"""Failure triage: which failure of a job came first, and what its log says.

When one worker fails its peers soon fail too, reporting it ("... reported:", "exited
while rank ...").  The launcher must name the root cause, not the last to go: a worker
killed by a signal, else a machine whose launcher went away, else a worker whose error
is its own, else the first failure seen.  One rule, ``root_cause``, for the workers of one
machine and for the reports of several machines.  A worker's log can be gigabytes; only
its end is read.
"""
import os
import re
import signal

# Failure triage reads at most this much of the end of a worker's log: a log can be
# gigabytes (a job that printed for days), and its root cause is in its last lines.
TRIAGE_BYTES = 256 * 1024

_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)): ")
# What a worker reports when it fails because another worker did (not a root cause).
CASCADE = ("reported:", "exited while rank", "disconnected while rank", "the job stopped")


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


def is_own(cause_line):
    """Whether an exception line is the worker's own error (not a report of a peer's)."""
    return bool(cause_line) and not any(c in cause_line for c in CASCADE)


def facts_of(returncode, log_path):
    """What triage knows of a failed worker: killed (by a signal), its exception line,
    and whether that error is its own."""
    cause = exception_line(log_path)
    return {"killed": returncode is not None and returncode < 0, "cause": cause,
            "own": is_own(cause)}


def root_cause(failures, facts):
    """The failure that came first: one killed by a signal, else a machine gone, else
    one whose error is its own, else the first.  ``facts(failure)``: a dict with any of
    ``killed``, ``gone``, ``own``."""
    for key in ("killed", "gone", "own"):
        chosen = [f for f in failures if facts(f).get(key)]
        if chosen:
            return chosen[0]
    return failures[0]


def describe_exit(code):
    if code is not None and code < 0:
        try:
            return "was killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with status %s" % code
