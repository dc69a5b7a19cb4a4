"""epl-launch's live view of its workers' progress, and the table at the end of a job.

Each worker appends JSON samples to ``worker_<i>.progress.jsonl`` in the launch's folder
(``epl.runtime.progress``); the launcher's watch loop calls ``poll()``, which reads what is new
and shows one status line per worker (step, steps/s, samples/s, loss):

* on a terminal, the lines are redrawn in place (ANSI cursor-up) below the workers'
  output, at most every ``interval`` seconds (0.5); a worker's output line erases the
  block first, and the next poll draws it again under that line;
* otherwise (a log file, a pipe) they are printed as plain lines, ``[progress] ...``,
  every ``interval`` seconds (10) when something changed, and once more at the end.

``summary(exit_codes)`` prints a table per worker: steps run, mean steps/s, samples/s,
last loss, exit status.  With ``log_json`` every sample read and the summary are also
written there, one JSON object per line (``"type": "status"`` / ``"summary"``), and what
the launcher adds with ``log()`` (``"type": "attempt"``: an attempt's run id).

Imports no TensorFlow (the launcher stays light).
"""
import json
import os
import shutil
import sys
import threading
import time

from epl.core.worker_files import progress_path

TTY_INTERVAL = 0.5
LOG_INTERVAL = 10.0


def _num(value, fmt):
    return fmt % value if value is not None else "-"


def status_line(record):
    """``worker 0: step 120  8.31 steps/s  266.0 samples/s  loss 0.4213``"""
    return "worker %s: step %s  %s steps/s  %s samples/s  loss %s%s" % (
        record.get("worker"), _num(record.get("step"), "%d"),
        _num(record.get("steps_per_sec"), "%.2f"), _num(record.get("samples_per_sec"), "%.1f"),
        _num(record.get("loss"), "%.4g"), "  (done)" if record.get("final") else "")


class _Terminal(object):
    """The launcher's stdout on a terminal: the status block stays the last lines; any
    other text written (the workers' output, from their pump threads) erases it first."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.RLock()
        self.drawn = 0            # lines of the status block now on the screen
        self.line_start = True

    def _erase(self):
        if self.drawn:
            self.stream.write("\x1b[%dA\r\x1b[J" % self.drawn)
            self.drawn = 0

    def write(self, text):
        with self.lock:
            self._erase()
            if text:
                self.line_start = text.endswith("\n")
            return self.stream.write(text)

    def draw(self, lines):
        with self.lock:
            self._erase()
            if not self.line_start:
                self.stream.write("\n")
                self.line_start = True
            columns = shutil.get_terminal_size((100, 20)).columns
            width = columns - 1 if columns > 20 else 200   # (a pty may report 0)
            for line in lines:   # (a wrapped line would break the cursor-up count)
                self.stream.write(line[:width] + "\n")
            self.drawn = len(lines)
            self.stream.flush()

    def flush(self):
        return self.stream.flush()

    def isatty(self):
        return True

    def __getattr__(self, name):
        return getattr(self.stream, name)


class ProgressDisplay(object):
    """The status of the workers ``workers`` (their EPL_WORKER_INDEX) of the launch folder
    ``launch_dir`` (None: none yet, see ``follow``)."""

    def __init__(self, launch_dir, workers, stream=None, log_json="", tty=None, interval=None):
        self.launch_dir = launch_dir
        self.workers = list(workers)
        own_stdout = stream is None
        stream = sys.stdout if stream is None else stream
        self.tty = stream.isatty() if tty is None else tty
        self.interval = interval if interval is not None else (
            TTY_INTERVAL if self.tty else LOG_INTERVAL)
        self.latest = {}          # worker -> its last record
        self.records = {}         # worker -> how many records were read
        self._offsets = {}        # worker -> bytes of its file read
        self._partial = {}        # worker -> an unfinished last line
        self._changed = False
        self._last_render = None
        self._json = open(log_json, "w") if log_json else None
        self._saved_stdout = None
        if self.tty:
            self.out = _Terminal(stream)
            if own_stdout:   # every print of the launcher and its pumps goes through it
                self._saved_stdout, sys.stdout = sys.stdout, self.out
        else:
            self.out = stream

    def follow(self, launch_dir, workers=None):
        """Read a new attempt's folder from its start (epl-launch --max_restarts starts
        the workers again with a new one); the last samples shown stay until theirs come."""
        self.poll()
        self.launch_dir = launch_dir
        if workers is not None:
            self.workers = list(workers)
        self._offsets.clear()
        self._partial.clear()

    def log(self, record):
        """Write ``record`` (a dict with its "type") to --log_json, if given."""
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

    def _read(self, worker):
        if not self.launch_dir:
            return []
        path = progress_path(self.launch_dir, worker)
        try:
            with open(path) as f:
                f.seek(self._offsets.get(worker, 0))
                text = f.read()
                self._offsets[worker] = f.tell()
        except OSError:
            return []
        text = self._partial.pop(worker, "") + text
        lines = text.split("\n")
        if lines[-1]:
            self._partial[worker] = lines[-1]
        out = []
        for line in lines[:-1]:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def poll(self, final=False):
        """Read the workers' new samples; render when due (``final``: now, if anything is
        new since the last render)."""
        for w in self.workers:
            for record in self._read(w):
                self.latest[w] = record
                self.records[w] = self.records.get(w, 0) + 1
                self._changed = True
                self.log(dict(record, type="status"))
        now = time.time()
        due = self._last_render is None or now - self._last_render >= self.interval
        if self._changed and (due or final):
            self.render()

    def lines(self):
        return [status_line(self.latest[w]) for w in self.workers if w in self.latest]

    def render(self):
        """The status lines: in place on a terminal, else as plain lines."""
        lines = self.lines()
        self._last_render = time.time()
        self._changed = False
        if not lines:
            return
        if self.tty:
            self.out.draw(lines)
        else:
            for line in lines:
                self.out.write("[progress] " + line + "\n")
            self.out.flush()

    def rows(self, exit_codes):
        """One summary row (a dict) per worker that reported progress."""
        out = []
        for w in self.workers:
            rec = self.latest.get(w)
            if rec is None:
                continue
            mean = rec.get("mean_steps_per_sec")
            batch = rec.get("global_batch")
            out.append({
                "worker": w, "steps": rec.get("runs"), "step": rec.get("step"),
                "mean_steps_per_sec": mean,
                "samples_per_sec": mean * batch if mean and batch else None,
                "global_batch": batch, "loss": rec.get("loss"),
                "exit_status": exit_codes.get(w)})
        return out

    def summary(self, exit_codes):
        """The table at the end of the job (nothing when no worker reported a step);
        ``exit_codes``: {worker: exit status}."""
        if self._saved_stdout is not None:
            sys.stdout, self._saved_stdout = self._saved_stdout, None
            self.out = sys.stdout
        rows = self.rows(exit_codes)
        if self._json is not None:
            self._json.write(json.dumps({"type": "summary", "workers": rows}) + "\n")
            self._json.close()
            self._json = None
        if not rows:
            return rows
        head = ("worker", "steps", "steps/s", "samples/s", "last loss", "exit")
        table = [head] + [(str(r["worker"]), _num(r["steps"], "%d"),
                           _num(r["mean_steps_per_sec"], "%.2f"),
                           _num(r["samples_per_sec"], "%.1f"), _num(r["loss"], "%.6g"),
                           _num(r["exit_status"], "%d")) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        self.out.write("\nepl-launch progress (steps/s, samples/s: means over the job "
                       "after its first step):\n")
        for row in table:
            self.out.write("  " + "  ".join(c.rjust(n) for c, n in zip(row, widths)) + "\n")
        self.out.flush()
        return rows
