"""Restarts across machines: machine 0's launcher decides, every machine's launcher obeys.

With --machine_list every machine runs its own epl-launch.  Under --max_restarts they must
agree on every restart, so one of them decides: machine 0's launcher also runs a
``Coordinator`` on machine 0's host, port + 2 x workers per machine.  Every launcher
(machine 0's too) connects to it over an authenticated link (epl.launch.channel) and
follows it (``follow_coordinator``): the coordinator says when an attempt starts and which
workers take part, and when to stop it; each launcher runs its own workers and reports
how they ended.

The coordinator applies the one restart rule (epl.launch.restart) to the reports, as the
one-machine launcher applies it to its workers: it restarts every machine's workers, and
drops a worker that was the root cause and fails again at start-up (while more than
--min_workers remain).  A launcher whose connection drops (its host died, it was killed, a
partition) is a failed machine: the coordinator waits --host_timeout for it to come back,
then drops its workers (--min_workers) or ends the job.  A machine none of whose workers
takes part any more is let go (its launcher ends, status 1, saying so); machine 0 stays,
as the coordinator, with or without workers.
"""
import queue
import socket
import threading
import time

from epl.launch import triage
from epl.launch.channel import accept_launcher, connect_to_coordinator
from epl.launch.display import ProgressDisplay
from epl.launch.launch_dirs import new_launch_dir
from epl.launch.ports import control_address, machine_table
from epl.launch.restart import RestartPolicy, failure, print_summary, run_attempts
from epl.launch.signals import GRACE_SECONDS, INTERRUPTS, JobSignals, reason_of
from epl.launch.workers import (Attempt, announce_attempt, finish_attempt, keep_log,
                                poll_attempt, shared_run_id, start_attempt)


class _Abort(Exception):
    """A launcher was stopped by its user: the job ends."""


class Coordinator(object):
    """Machine 0's decisions for a --machine_list job with --max_restarts (see above); the
    runner of ``restart.run_attempts`` across machines."""

    def __init__(self, a, job_id, secret):
        self.a, self.job_id, self.secret = a, job_id, secret
        table, self.per = machine_table(a)
        self.hosts = [h for h, _ in table]
        self.events = queue.Queue()
        self.channels = {}
        self.machines = list(range(len(self.hosts)))   # those of the running attempt
        self.released = set()                          # machines let go
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
        accepted = accept_launcher(sock, peer, self.secret, self.job_id, len(self.hosts))
        if accepted is not None:
            k, ch = accepted
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

    def _let_go(self, k):
        """Tell machine ``k``'s launcher, which runs none of the job's workers any more,
        to end."""
        self.released.add(k)
        self._send_all([k], {"type": "finish", "code": 1, "message":
                             "epl-launch: machine %d was dropped from the job: none of its "
                             "workers takes part any more (machine 0's output says why)" % k})

    def describe(self, k, report):
        where = "machine %d (%s)" % (k, self.hosts[k])
        if report.get("type") == "gone":
            return where + ": its launcher went away (the host, or its epl-launch, is gone)"
        return "%s: worker %d %s%s" % (where, report["worker"], report["reason"],
                                      "\n  " + report["cause"] if report.get("cause") else "")

    def _run(self):
        try:
            code, message = self._drive()
        except _Abort as e:
            code, message = 1, "epl-launch: %s; stopped all workers." % e
        except Exception as e:  # pylint: disable=broad-except
            code, message = 1, "epl-launch: the coordinator failed: %r" % e
        machines = sorted((k for k in self.channels if k not in self.released),
                          key=lambda k: k == 0)   # (machine 0's last)
        self._send_all(machines, {"type": "finish", "code": code, "message": message})
        self.listener.close()

    def _drive(self):
        a = self.a
        missing = self._wait_for(range(len(self.hosts)), a.host_timeout)
        if missing:
            return 1, ("epl-launch: the launcher of machine(s) %s did not connect to machine "
                       "0's within --host_timeout %gs" % (missing, a.host_timeout))
        outcome = run_attempts(RestartPolicy.of(a), self, list(range(a.num_workers)))
        if outcome.failure is None:
            return 0, ""
        return 1, "\n".join(x for x in (outcome.failure.what, outcome.reason) if x)

    # -- the runner of restart.run_attempts ---------------------------------------------

    def run_attempt(self, number, workers, note):
        self.machines = sorted(set([0] + [w // self.per for w in workers]))
        for k in list(self.channels):
            if k not in self.machines and k not in self.released:
                self._let_go(k)
        start = time.time()
        self._send_all(self.machines, {
            "type": "start", "attempt": number, "workers": list(workers), "note": note,
            "run_id": shared_run_id(self.job_id, self.secret, number)})
        reports, done = [], set()
        while not reports:   # the attempt runs
            event = self._next(time.time() + 3600)
            if event is None:
                continue
            k, msg = event
            if msg["type"] == "connected" and k not in self.machines:
                self._let_go(k)
            elif msg["type"] == "done" and msg["attempt"] == number:
                done.add(k)
                if done >= set(self.machines):
                    return None
            elif msg["type"] == "failed" and msg["attempt"] == number:
                reports.append((k, msg))
            elif msg["type"] == "gone" and k in self.machines:
                reports.append((k, msg))
        ran = time.time() - start
        self._send_all(self.machines, {"type": "stop", "attempt": number})
        pending = set(k for k in self.machines if k in self.channels)
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
            elif msg["type"] == "gone" and k in self.machines:
                pending.discard(k)
                if all(r[0] != k for r in reports):
                    reports.append((k, msg))
        k, cause = triage.root_cause(
            reports, lambda r: dict(r[1], gone=r[1].get("type") == "gone"))
        worker = cause.get("worker", -1) if cause.get("type") == "failed" else -1
        return failure(number, ran, worker if worker >= 0 else None,
                       bool(cause.get("joined")), bool(cause.get("final")),
                       "epl-launch: attempt %d failed after %.1f s: %s"
                       % (number, ran, self.describe(k, cause)),
                       gone=[k for k, r in reports if r.get("type") == "gone"])

    def wait_for_machines(self, gone):
        stayed = self._wait_for(gone, self.a.host_timeout)
        return ([w for w in range(self.a.num_workers) if w // self.per in stayed],
                "%s did not come back within --host_timeout %gs" % (
                    ", ".join("machine %d (%s)" % (k, self.hosts[k]) for k in stayed),
                    self.a.host_timeout))

    def restarting(self, failed):
        return []   # (each machine keeps its own logs when the next attempt starts)


def report_of(a, attempt, failed, reason, final):
    """What this machine tells the coordinator about its attempt's end."""
    if reason is None:
        return {"type": "done", "attempt": attempt.number}
    facts = (triage.facts_of(failed.proc.returncode, failed.log_path)
             if failed is not None else {"killed": False, "cause": "", "own": False})
    return dict(facts, type="failed", attempt=attempt.number, machine=a.machine_rank,
                worker=failed.index if failed is not None else -1, reason=reason,
                final=final, joined=attempt.cause_joined)


def follow_coordinator(a, job_id, secret, gpus):
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
    with JobSignals() as signals:
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
                    start_attempt(a, attempt, msg["workers"], job_id, secret, gpus)
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
        except INTERRUPTS as e:
            ch.send({"type": "abort", "reason": reason_of(e)})
            message = "epl-launch: %s; stopped all workers." % reason_of(e)
        finally:
            signals.hold()   # (from here on a Ctrl-C does not cut the stop or the summary short)
            try:
                finish_attempt(attempt, display, None, "stopped")
            finally:
                if coordinator is not None:
                    coordinator.thread.join(GRACE_SECONDS + 20)
                ch.close()
        print_summary("epl-launch summary (machine %d)" % a.machine_rank, attempt, display,
                      a.log_dir, message)
        return code
