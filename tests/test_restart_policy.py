"""epl-launch's one restart rule (epl.launch.restart), without processes: the pure
``RestartPolicy.on_failure`` and the attempt loop ``run_attempts`` over a scripted runner.
The launches themselves are tests/test_restarts.py."""
from epl.launch import restart
from epl.launch.restart import DROP, GIVE_UP, RESTART, START, RestartPolicy, RestartState, failure


def _policy(max_restarts=3, window=3600, min_workers=None, workers=4):
    return RestartPolicy(max_restarts, window, workers if min_workers is None else min_workers,
                         workers)


def test_a_failure_restarts_every_worker_and_counts():
    d = _policy().on_failure(START, failure(0, 5.0, worker=1, what="w1"), [0, 1, 2, 3])
    assert (d.action, d.reason, d.workers, d.dropped) == (RESTART, "", [0, 1, 2, 3], ())
    assert d.state == RestartState(1, 1)


def test_no_restarts_left_gives_up_naming_the_count():
    d = _policy(max_restarts=2).on_failure(RestartState(2, 1), failure(2, 5.0, worker=1),
                                           [0, 1])
    assert d.action == GIVE_UP and d.state == RestartState(2, 1)
    assert d.reason == ("epl-launch: the job failed after 2 restart(s): --max_restarts 2 "
                        "(the count resets after 3600 s of running)")


def test_without_restarts_the_first_failure_ends_the_job_quietly():
    d = _policy(max_restarts=0).on_failure(START, failure(0, 1.0, worker=0), [0, 1])
    assert (d.action, d.reason) == (GIVE_UP, "")


def test_the_window_resets_the_count():
    policy = _policy(max_restarts=1, window=10)
    assert policy.on_failure(RestartState(1, 1), failure(1, 9.9, worker=1), [0, 1]).action \
        == GIVE_UP
    d = policy.on_failure(RestartState(1, 1), failure(1, 10.0, worker=1), [0, 1])
    assert d.action == RESTART and d.state == RestartState(1, 1)


def test_a_timeout_is_never_restarted():
    d = _policy().on_failure(START, failure(0, 99.0, worker=0, final=True), [0, 1])
    assert (d.action, d.reason) == (GIVE_UP, "")


def test_the_root_cause_failing_again_at_start_up_is_dropped():
    policy = _policy(min_workers=2)
    d = policy.on_failure(RestartState(1, 2), failure(1, 0.5, worker=2, joined=False),
                          [0, 1, 2, 3])
    assert (d.action, d.workers, d.dropped) == (DROP, [0, 1, 3], (2,))
    assert d.state == RestartState(2, 2)   # (a drop is a restart: it counts)
    assert d.reason.startswith(
        "epl-launch: worker 2 failed again at start-up (before it joined the job): dropped "
        "for good; the job goes on with 3 worker(s) (--min_workers 2): worker 0 is rank 0, "
        "worker 1 is rank 1, worker 3 is rank 2. Every worker keeps its batch, so the "
        "global batch is now 3 of the 4 workers' batches"), d.reason


def test_what_is_not_dropped():
    policy = _policy(min_workers=2)
    workers = [0, 1, 2, 3]
    for state, failed, on in (
            (RestartState(1, 2), failure(1, 0.5, worker=2, joined=True), workers),  # joined
            (RestartState(1, 1), failure(1, 0.5, worker=2), workers),   # another worker
            (START, failure(0, 0.5, worker=2), workers),                # its first failure
            (RestartState(1, 2), failure(1, 0.5, worker=2), [0, 2]),    # at --min_workers
            (RestartState(1, None), failure(1, 0.5, worker=None), workers)):   # no worker
        d = policy.on_failure(state, failed, on)
        assert (d.action, d.workers) == (RESTART, on), (state, failed)
    assert _policy().on_failure(RestartState(1, 2), failure(1, 0.5, worker=2), workers) \
        .action == RESTART   # (--min_workers defaults to --num_workers: never drop)


def test_the_workers_of_a_machine_that_stayed_away():
    policy = _policy(min_workers=2)
    lost = failure(0, 3.0, gone=[1], lost=[2, 3],
                   lost_what="machine 1 (hostB) did not come back within --host_timeout 3s")
    d = policy.on_failure(START, lost, [0, 1, 2, 3])
    assert (d.action, d.workers, d.dropped) == (DROP, [0, 1], (2, 3))
    assert "machine 1 (hostB) did not come back within --host_timeout 3s: dropped for good; " \
        "the job goes on with 2 worker(s) (--min_workers 2)" in d.reason
    d = _policy(min_workers=3).on_failure(START, lost, [0, 1, 2, 3])
    assert d.action == GIVE_UP and d.reason == (
        "epl-launch: machine 1 (hostB) did not come back within --host_timeout 3s, and "
        "without it fewer than --min_workers 3 workers remain")


class _Runner(object):
    """A scripted runner: attempt k ends with ``script[k]`` (None: success); machines in
    ``away`` stay away."""

    def __init__(self, script, away=()):
        self.script, self.away, self.started, self.notes = list(script), set(away), [], []

    def run_attempt(self, number, workers, note):
        self.started.append(list(workers))
        self.notes.append(note)
        return self.script[number]

    def wait_for_machines(self, gone):
        stayed = [k for k in gone if k in self.away]
        return [w for w in range(4) if w // 2 in stayed], "machine(s) %s stayed away" % stayed

    def restarting(self, failed):
        return ["  (logs kept)"]


def test_the_loop_restarts_drops_and_ends():
    runner = _Runner([failure(0, 5.0, worker=3, what="attempt 0: worker 3 was killed"),
                      failure(1, 0.2, worker=3, what="attempt 1: worker 3 exited"),
                      None])
    out = restart.run_attempts(_policy(min_workers=2), runner, [0, 1, 2, 3])
    assert out == restart.Outcome(0, None, "", 2)
    assert runner.started == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2]]
    assert runner.notes[1].splitlines() == [
        "attempt 0: worker 3 was killed", "  (logs kept)",
        "epl-launch: restart 1 of 3 (EPL_RESTART_COUNT=1): starting 4 worker(s) again; "
        "training resumes from the job's newest checkpoint"]
    assert "worker 3 failed again at start-up" in runner.notes[2]
    assert runner.notes[2].endswith("restart 2 of 3 (EPL_RESTART_COUNT=2): starting 3 "
                                    "worker(s) again; training resumes from the job's "
                                    "newest checkpoint")


def test_the_loop_waits_for_machines_only_when_it_goes_on():
    gone = failure(0, 5.0, what="machine 1 went away", gone=[1])
    runner = _Runner([gone, None], away=[1])
    out = restart.run_attempts(_policy(min_workers=2), runner, [0, 1, 2, 3])
    assert out.code == 0 and runner.started[1] == [0, 1]
    assert "machine(s) [1] stayed away: dropped for good" in runner.notes[1]
    runner = _Runner([gone], away=[1])
    out = restart.run_attempts(_policy(max_restarts=0), runner, [0, 1, 2, 3])
    assert (out.code, out.failure, out.reason) == (1, gone, "")
    runner = _Runner([gone], away=[1])
    out = restart.run_attempts(_policy(min_workers=3), runner, [0, 1, 2, 3])
    assert out.code == 1 and "fewer than --min_workers 3" in out.reason
