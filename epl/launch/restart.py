"""The restart rule of epl-launch, once: what to do when an attempt fails, the loop that
runs attempts by it, and the summary at the end of a job.

The same rule holds on one machine and across machines (--machine_list, where machine 0's
launcher decides for all; epl.launch.coordinator), so it is written once, as a pure
function -- ``RestartPolicy.on_failure(state, failure, workers)`` gives a ``Decision``,
with no process, clock or output in it, and the unit tests call it directly:

==========================================================  ==========================
the failure                                                 decision
==========================================================  ==========================
restarting cannot help (--timeout)                          give up
no restarts left (--max_restarts, counted since the last    give up: "the job failed
attempt that ran --restart_window seconds)                  after K restart(s)"
a machine's launcher stayed away (--host_timeout)           drop its workers, or give
                                                            up when fewer than
                                                            --min_workers would remain
the previous failure's root cause fails again before it     drop that worker (while
joined the job                                              more than --min_workers
                                                            remain)
otherwise                                                   restart every worker
==========================================================  ==========================

A drop is a restart too: it counts against --max_restarts.  ``run_attempts`` is the one
loop over attempts; a runner does the work of an attempt on its side (``cli.LocalAttempts``
for one machine, ``coordinator.Coordinator`` across machines).
"""
import collections

from epl.core.worker_files import RESTART_COUNT_ENV

RESTART, DROP, GIVE_UP = "restart", "drop", "give up"

# A failed attempt, as the policy sees it.  ``attempt``: its number; ``seconds``: how long
# it ran; ``worker``: the root cause's launch index (None: none, e.g. a machine went
# away); ``joined``: whether that worker had joined the job; ``final``: a restart cannot
# help (--timeout); ``what``: the line that names the failure; ``gone``: machines whose
# launcher went away; ``lost``: launch indices of the workers of machines that did not
# come back (known after the wait for them), ``lost_what`` names them.
Failure = collections.namedtuple(
    "Failure", "attempt seconds worker joined final what gone lost lost_what")


def failure(attempt, seconds, worker=None, joined=False, final=False, what="", gone=(),
            lost=(), lost_what=""):
    return Failure(attempt, seconds, worker, joined, final, what, tuple(gone), tuple(lost),
                   lost_what)


# What the policy remembers between failures: restarts counted against --max_restarts
# (the window resets it) and the launch index of the previous failure's root cause.
RestartState = collections.namedtuple("RestartState", "used last_cause")
START = RestartState(0, None)

# ``action``: RESTART, DROP or GIVE_UP; ``reason``: the line that says why (a drop, a
# give-up; "" for a plain restart); ``workers``: the next attempt's workers (launch
# indices, in rank order); ``dropped``: those dropped; ``state``: the next RestartState.
Decision = collections.namedtuple("Decision", "action reason workers dropped state")

_BATCH_RULE = ("Every worker keeps its batch, so the global batch is now %d of the %d "
               "workers' batches; input sliced by io.slicing is re-sharded over the "
               "remaining workers.")


class RestartPolicy(object):
    """--max_restarts, --restart_window, --min_workers, applied to failures (see above)."""

    def __init__(self, max_restarts, restart_window, min_workers, num_workers):
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.min_workers = min_workers
        self.num_workers = num_workers

    @classmethod
    def of(cls, a):
        return cls(a.max_restarts, a.restart_window, a.min_workers, a.num_workers)

    def on_failure(self, state, failed, workers):
        """The decision on the failure ``failed`` (a Failure) of an attempt of ``workers``."""
        workers = list(workers)

        def give_up(reason):
            return Decision(GIVE_UP, reason, workers, (), state)

        if failed.final:
            return give_up("")
        used = 0 if failed.seconds >= self.restart_window else state.used
        if used >= self.max_restarts:
            return give_up("" if not self.max_restarts else
                           "epl-launch: the job failed after %d restart(s): --max_restarts %d "
                           "(the count resets after %g s of running)"
                           % (failed.attempt, self.max_restarts, self.restart_window))
        after = RestartState(used + 1, failed.worker)
        if failed.lost:
            left = [w for w in workers if w not in failed.lost]
            if len(left) < self.min_workers:
                return give_up("epl-launch: %s, and without it fewer than --min_workers %d "
                               "workers remain" % (failed.lost_what, self.min_workers))
            return self._drop(failed.lost_what, workers, failed.lost, after)
        if (failed.worker is not None and failed.worker == state.last_cause
                and not failed.joined and len(workers) > self.min_workers):
            return self._drop("worker %d failed again at start-up (before it joined the job)"
                              % failed.worker, workers, [failed.worker], after)
        return Decision(RESTART, "", workers, (), after)

    def _drop(self, what, workers, dropped, after):
        left = [w for w in workers if w not in dropped]
        reason = ("epl-launch: %s: dropped for good; the job goes on with %d worker(s) "
                  "(--min_workers %d): %s. " % (
                      what, len(left), self.min_workers,
                      ", ".join("worker %d is rank %d" % (i, r) for r, i in enumerate(left)))
                  + _BATCH_RULE % (len(left), self.num_workers))
        return Decision(DROP, reason, left, tuple(d for d in workers if d in dropped), after)

    def restart_line(self, state, number, workers):
        """The line that starts attempt ``number`` again, after a failure."""
        return ("epl-launch: restart %d of %d (%s=%d): starting %d worker(s) again; training "
                "resumes from the job's newest checkpoint"
                % (state.used, self.max_restarts, RESTART_COUNT_ENV, number, len(workers)))


# What ``run_attempts`` ends with: the exit status, the last failure (None: the job
# succeeded), the policy's last word ("" when none), the number of the last attempt.
Outcome = collections.namedtuple("Outcome", "code failure reason attempts")


def run_attempts(policy, runner, workers):
    """Run the job's attempts until one succeeds or the policy gives up.  ``runner``:

    * ``run_attempt(number, workers, note)``: start attempt ``number`` of ``workers``
      (``note``: the lines on the previous failure and the decision, to print), wait for
      its end; None when every worker succeeded, else a Failure;
    * ``wait_for_machines(gone)``: after a decision to go on, wait for the machines whose
      launcher went away; (launch indices of the workers of those that stay away, a line
      naming them);
    * ``restarting(failed)``: extra lines after the failure's (a restart follows).
    """
    state, number, note = START, 0, ""
    while True:
        failed = runner.run_attempt(number, workers, note)
        if failed is None:
            return Outcome(0, None, "", number)
        decision = policy.on_failure(state, failed, workers)
        if decision.action != GIVE_UP and failed.gone:
            lost, lost_what = runner.wait_for_machines(failed.gone)
            if lost:
                failed = Failure(*(tuple(failed[:-2]) + (tuple(lost), lost_what)))
                decision = policy.on_failure(state, failed, workers)
        if decision.action == GIVE_UP:
            return Outcome(1, failed, decision.reason, number)
        lines = [failed.what] + list(runner.restarting(failed))
        if decision.reason:
            lines.append(decision.reason)
        workers, state, number = decision.workers, decision.state, number + 1
        lines.append(policy.restart_line(state, number, workers))
        note = "\n".join(lines)


def print_summary(title, attempt, display, log_dir, message):
    """The end of a job on this machine: its workers' exit statuses and logs, the
    restarts, the progress table, then ``message`` (how the job ended, when it failed)."""
    print("\n%s:" % title)
    for w in attempt.workers if attempt else []:
        print("  worker %d: %s  log %s" % (w.index, "exit %s" % w.proc.returncode, w.log_path))
    if attempt is not None and attempt.number:
        print("  %d restart(s); the logs of earlier attempts: worker_<i>.attempt<k>.log in %s"
              % (attempt.number, log_dir))
    display.summary(dict((w.rank, w.proc.returncode) for w in attempt.workers)
                    if attempt else {})
    if message:
        print("\n" + message, flush=True)
