"""epl-launch --max_restarts / --restart_window / --min_workers (issue 27): a job that
survives a lost worker.  Every job runs under a hard timeout; every test checks that no
worker is left running and none of its runs' shared memory
(/dev/shm/epl-<run>-*, the runs it printed) is left behind."""
import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from tests import models
from tests import restart_train as rt

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _segments(out):
    """The shared-memory segments left of the runs ``out`` (epl-launch's output) names,
    one a line for each attempt (other jobs of this machine may hold segments of their
    own meanwhile)."""
    runs = set(re.findall(r"epl-launch: attempt \d+: run ([0-9a-f]+)", out))
    assert runs, out[-3000:]
    return [p for r in sorted(runs) for p in glob.glob("/dev/shm/epl-%s-*" % r)]


def _running(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch(args, env_extra=None, timeout=150):
    """Run epl-launch ``args``: (exit status, output).  Fails the test if it hangs."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("EPL_JOB_ID", None)
    env.update(env_extra or {})
    try:
        out = subprocess.run([sys.executable, "-m", "epl.launch"] + args, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail("epl-launch hung:\n%s" % (e.output or b"").decode()[-5000:])
    return out.returncode, out.stdout.decode("utf-8", "replace")


def _nothing_left(tmp_path, out):
    """No worker of any attempt still runs (each wrote its pid), no segment of the job's
    runs is left."""
    pids = [int(p.read_text()) for p in tmp_path.glob("pid_*")]
    assert pids
    deadline = time.time() + 10
    while any(_running(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _running(p)], "workers outlived epl-launch"
    assert _segments(out) == []


# -- the launcher's rules, with workers that need no TensorFlow ------------------------

FLAKY = """import os, sys, time
attempt = int(os.environ["EPL_RESTART_COUNT"])
rank = os.environ["EPL_WORKER_INDEX"]
open(os.path.join(sys.argv[1], "pid_%d_%s" % (attempt, rank)), "w").write(str(os.getpid()))
print("attempt %d rank %s of %s workers" % (attempt, rank, os.environ["EPL_LAUNCH_NUM_WORKERS"]),
      flush=True)
if rank == "1":
    if attempt < int(sys.argv[2]):   # the first attempts run a while before they fail
        time.sleep(float(sys.argv[3]))
    raise ValueError("worker 1 broke in attempt %d" % attempt)
time.sleep(60)
"""


def _flaky(tmp_path, restarts, window, slow_attempts, seconds):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    args = ["--num_workers", "2", "--max_restarts", str(restarts), "--log_dir",
            str(tmp_path / "logs")]
    if window:
        args += ["--restart_window", str(window)]
    return _launch(args + [str(script), str(tmp_path), str(slow_attempts), str(seconds)],
                   timeout=60)


def test_after_n_restarts_the_job_fails_naming_the_root_cause(tmp_path):
    """Worker 1 fails in every attempt: 2 restarts, then the job fails with worker 1's
    exception (not worker 0, which the launcher stopped), each restart logged with it."""
    code, out = _flaky(tmp_path, 2, 0, 0, 0)
    assert code == 1, out
    for k in range(3):
        assert "attempt %d rank 1 of 2 workers" % k in out, out
    assert "attempt 3 " not in out
    for k in (1, 2):
        assert "restart %d of 2 (EPL_RESTART_COUNT=%d)" % (k, k) in out, out
    assert out.count("ValueError: worker 1 broke in attempt") >= 3
    final = out[out.index("epl-launch summary"):]
    assert "worker 1 exited with status 1; stopped the others." in final, final
    assert "ValueError: worker 1 broke in attempt 2" in final, final
    assert "the job failed after 2 restart(s)" in final, final
    for k in (0, 1):   # the earlier attempts' logs are kept
        assert "broke in attempt %d" % k in (
            tmp_path / "logs" / ("worker_1.attempt%d.log" % k)).read_text()
    _nothing_left(tmp_path, out)


def test_the_restart_window_resets_the_count(tmp_path):
    """Attempts 0-2 run 1.5 s before worker 1 fails, longer than --restart_window 1: each
    failure finds the count reset, so --max_restarts 1 allows all of them; attempt 3
    fails at once and ends the job.  Without the window the job ends after attempt 1."""
    code, out = _flaky(tmp_path, 1, 1, 3, 1.5)
    assert code == 1, out
    assert "attempt 3 rank 1" in out and "attempt 4 " not in out, out
    assert out.count("restart 1 of 1") == 3, out
    assert "the job failed after 3 restart(s)" in out, out
    code, out = _flaky(tmp_path, 1, 0, 3, 1.5)   # the default window: an hour
    assert code == 1 and "attempt 1 rank 1" in out and "attempt 2 " not in out, out


def test_restart_flags_are_checked(capsys):
    from epl.launch import cli
    for args, says in ((["--max_restarts", "-1"], "--max_restarts must be >= 0"),
                       (["--restart_window", "0"], "--restart_window must be > 0"),
                       (["--min_workers", "3"], "--min_workers must be between 1 and"),
                       (["--min_workers", "1"], "give --max_restarts N")):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(["--num_workers", "2"] + args + [__file__])
        assert e.value.code == 2
        assert says in capsys.readouterr().err


# -- a training job that loses a worker -------------------------------------------------

def _local(batches, optimizer="adam"):
    """The oracle: the local model trained on ``batches`` [(x, y)] one after the other."""
    with tf.Graph().as_default():
        px = tf.placeholder(tf.float32, [None, models.IN])
        py = tf.placeholder(tf.int64, [None])
        _, loss = models.forward(px, py)
        op = models.train_op(loss, optimizer, tf.train.get_or_create_global_step())
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for bx, by in batches:
                sess.run(op, {px: bx, py: by})
            return models.weights(sess)


def _train_job(tmp_path, extra_args, env_extra, script_args=()):
    data = tmp_path / "data"
    data.mkdir()
    x, y = rt.write_files(str(data))
    code, out = _launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                         str(tmp_path / "logs")] + extra_args +
                        [os.path.join(HERE, "restart_train.py"), str(tmp_path), str(data)] +
                        list(script_args), env_extra)
    return code, out, (x, y)


def _restored_step(out, attempt, worker=0):
    found = re.findall(r"attempt %d: worker %d of \d+ starts at global step (\d+)"
                       % (attempt, worker), out)
    assert found, out[-5000:]
    return int(found[0])


def _final_checkpoint(tmp_path):
    path = tf.train.latest_checkpoint(str(tmp_path / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    return reader.get_tensor("global_step"), {k: reader.get_tensor(k)
                                              for k in models.initial_weights()}


def test_kill_9_at_step_5_restarts_and_equals_an_uninterrupted_run(tmp_path):
    """Worker 1 is killed (SIGKILL) after step 5 of 10 under --max_restarts 1: the
    launcher names it, starts both workers again, they restore the newest checkpoint
    (global_step, Adam's slots) and read on from the restored step; the final weights
    of both workers and of the last checkpoint equal the uninterrupted run's."""
    code, out, (x, y) = _train_job(tmp_path, ["--max_restarts", "1"],
                                           {"RESTART_KILL": "1:5"})
    assert code == 0, out[-6000:]
    assert "attempt 0: worker 1 was killed by SIGKILL" in out, out[-6000:]
    assert "restart 1 of 1 (EPL_RESTART_COUNT=1): starting 2 worker(s) again" in out
    start = _restored_step(out, 1)
    assert 1 <= start <= 5, start
    print("attempt 1 restored global step %d" % start)
    want = _local([rt.global_batch(x, y, 2, s) for s in range(rt.STEPS)])
    for w in range(2):
        models.assert_weights_close(dict(np.load(str(tmp_path / ("worker_%d.npz" % w)))),
                                    want)
    step, weights = _final_checkpoint(tmp_path)
    assert step == rt.STEPS
    models.assert_weights_close(weights, want)
    _nothing_left(tmp_path, out)


@pytest.mark.estimator
def test_an_estimator_job_restarts_from_its_model_dir(tmp_path):
    """The same kill -9 with the job as an Estimator (model_dir = the checkpoint folder,
    a checkpoint every step): the restarted Estimator restores its newest checkpoint and
    its last one equals the uninterrupted run."""
    code, out, (x, y) = _train_job(tmp_path, ["--max_restarts", "1"],
                                           {"RESTART_KILL": "1:5"}, ["estimator"])
    assert code == 0, out[-6000:]
    assert "attempt 0: worker 1 was killed by SIGKILL" in out, out[-6000:]
    start = _restored_step(out, 1)
    assert 1 <= start <= 5, start
    step, weights = _final_checkpoint(tmp_path)
    assert step == rt.STEPS
    models.assert_weights_close(
        weights, _local([rt.global_batch(x, y, 2, s) for s in range(rt.STEPS)]))
    _nothing_left(tmp_path, out)


def test_a_worker_that_stays_down_is_dropped(tmp_path):
    """Worker 1 is killed after step 5, then fails at start-up in the restarted attempt:
    under --min_workers 1 it is dropped and worker 0 finishes alone from the newest
    checkpoint.  The documented rule: every worker keeps its batch (the global batch
    shrinks from 2 to 1 worker's batch), the learning rate is the program's, and
    io.slicing gives the remaining worker every file; the input position is the global
    step.  So the weights are the local model's on the 2-worker global batches up to the
    restored step, then on worker 0's batches of all the files."""
    code, out, (x, y) = _train_job(
        tmp_path, ["--max_restarts", "2", "--min_workers", "1"],
        {"RESTART_KILL": "1:5", "RESTART_DOWN": "1"})
    assert code == 0, out[-6000:]
    assert "worker 1: its host is down" in out
    assert "worker 1 failed again at start-up (before it joined the job): dropped for good; " \
           "the job goes on with 1 worker(s) (--min_workers 1): worker 0 is rank 0" in out, \
        out[-6000:]
    assert "restart 2 of 2 (EPL_RESTART_COUNT=2): starting 1 worker(s) again" in out
    assert re.search(r"attempt 2: worker 0 of 1 starts", out), out[-6000:]
    start = _restored_step(out, 2)
    assert 1 <= start <= 5, start
    print("the remaining worker restored global step %d" % start)
    want = _local([rt.global_batch(x, y, 2, s) for s in range(start)] +
                  [rt.global_batch(x, y, 1, s) for s in range(start, rt.STEPS)])
    models.assert_weights_close(dict(np.load(str(tmp_path / "worker_0.npz"))), want)
    step, weights = _final_checkpoint(tmp_path)
    assert step == rt.STEPS
    models.assert_weights_close(weights, want)
    _nothing_left(tmp_path, out)


# -- EPL's own state across a restore ----------------------------------------------------

def _state_program(config, ckpt_dir, runs):
    """The models' MLP under ``config`` (on 2 devices) in a MonitoredTrainingSession that
    checkpoints every step into ``ckpt_dir`` (restoring the newest checkpoint first):
    ``runs`` runs of the train op.  Returns (global step and EPL's own variables right
    after the session restored or initialized, the same after the runs, the weights)."""
    import epl
    from epl.ir import internal_state
    models.reset()
    epl.init(epl.Config(dict(config, **{"cluster.devices_per_worker": 2})))
    if "pipeline.num_micro_batch" not in config:   # (accumulation across runs: no annotation)
        epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(64)
    bx, by = models.input_batch(x, y, 4)
    _, loss = models.forward(bx, by)
    gs = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", gs)
    state = {v.op.name: v for v in tf.get_collection(internal_state.COLLECTION)}
    assert state
    with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt_dir, save_checkpoint_steps=1,
                                           save_summaries_steps=None,
                                           save_summaries_secs=None,
                                           log_step_count_steps=None) as sess:
        first = sess.run([gs, state])
        for _ in range(runs):
            sess.run(op)
        return first, sess.run([gs, state]), models.weights(sess)


@pytest.mark.parametrize("feature", ["amp", "accumulate"])
def test_epl_state_starts_again_when_a_checkpoint_is_restored(tmp_path, feature):
    """EPL's own state is not in checkpoints (they interchange with the program without
    the feature): a session that restores one -- a restarted job's -- starts it again
    at its initial values (the dynamic loss scale and its count of good steps; the run
    accumulators and their run counter), and the model is restored."""
    config = ({"amp.level": "O1"} if feature == "amp"
              else {"pipeline.num_micro_batch": 2})
    ckpt = str(tmp_path / "ckpt")
    (step0, initial), (step, trained), weights = _state_program(config, ckpt, 3)
    assert step0 == 0
    changed = [k for k in initial if not np.array_equal(initial[k], trained[k])]
    assert changed, trained   # (the runs changed EPL's state: the test can fail)
    (restored_step, restored), _, _ = _state_program(config, ckpt, 0)
    assert restored_step == step == (3 if feature == "amp" else 1)
    for k in initial:
        np.testing.assert_array_equal(restored[k], initial[k], err_msg=k)
    models.reset()
    with tf.Graph().as_default():   # the model itself is the checkpoint's
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt))
        models.assert_weights_close({k: reader.get_tensor(k) for k in weights}, weights,
                                    rtol=0, atol=0)


# -- several machines: one launcher each, machine 0's coordinates ------------------------

def _machines(count):
    """A --machine_list of ``count`` 'hosts' on 127.0.0.2, 127.0.0.3, ... with 3 free
    ports each (1 worker: TensorFlow's port, EPL's, and on machine 0 the coordinator's)."""
    from epl.launch.ports import free_port_block
    return ",".join("127.0.0.%d:%d" % (2 + m, free_port_block(3, "127.0.0.%d" % (2 + m)))
                    for m in range(count))


class _Launchers(object):
    """One epl-launch per machine of a 2-machine job of restart_train.py; their output is
    read on threads (so a test can wait for a line, and kill a launcher); machine r's
    --log_json is tmp_path/progress<r>.json."""

    def __init__(self, tmp_path, args, env_extra):
        data = tmp_path / "data"
        data.mkdir()
        self.x, self.y = rt.write_files(str(data))
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   EPL_JOB_SECRET="a-secret-both-machines-share", **env_extra)
        env.pop("EPL_JOB_ID", None)
        machines = _machines(2)
        self.env, self.procs, self.outs, self.cmds = env, [None, None], [[], []], []
        for r in (0, 1):
            self.cmds.append(
                [sys.executable, "-m", "epl.launch", "--num_workers", "2", "--machine_list",
                 machines, "--machine_rank", str(r), "--log_dir", str(tmp_path / ("logs%d" % r)),
                 "--log_json", str(tmp_path / ("progress%d.json" % r))]
                + args + [os.path.join(HERE, "restart_train.py"), str(tmp_path), str(data)])
            self.start(r)

    def start(self, r):
        """(Re)start machine ``r``'s launcher; its output so far is dropped."""
        import threading
        self.outs[r] = []
        self.procs[r] = subprocess.Popen(self.cmds[r], env=self.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT)
        threading.Thread(target=self._pump, args=(self.procs[r], self.outs[r]),
                         daemon=True).start()

    @staticmethod
    def _pump(proc, lines):
        for raw in iter(proc.stdout.readline, b""):
            lines.append(raw.decode("utf-8", "replace"))

    def out(self, r):
        return "".join(self.outs[r])

    def wait_for(self, r, text, timeout=120):
        deadline = time.time() + timeout
        while text not in self.out(r):
            if time.time() > deadline or self.procs[r].poll() is not None:
                self.kill()
                pytest.fail("no %r from machine %d:\n%s" % (text, r, self.out(r)[-5000:]))
            time.sleep(0.05)

    def finish(self, timeout=150):
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail("a launcher hung:\n%s\n%s" % (self.out(0)[-4000:],
                                                            self.out(1)[-4000:]))
        time.sleep(0.2)   # (the last lines)
        return [p.returncode for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_machines_restart_together(tmp_path):
    """Worker 1 (machine 1) is killed after step 5: machine 0's launcher, which
    coordinates, names it and both machines start their workers again; the final
    weights equal the uninterrupted run's.  Each machine's launcher shows its own
    worker's progress: the summary row (and --log_json's) holds the steps its restarted
    process ran, from the restored step to the last."""
    job = _Launchers(tmp_path, ["--max_restarts", "1", "--host_timeout", "60"],
                     {"RESTART_KILL": "1:5"})
    codes = job.finish()
    out0, out1 = job.out(0), job.out(1)
    assert codes == [0, 0], out0[-5000:] + out1[-5000:]
    for out in (out0, out1):
        assert "attempt 0 failed after" in out and \
            "machine 1 (127.0.0.3): worker 1 was killed by SIGKILL" in out, out[-5000:]
        assert "restart 1 of 1 (EPL_RESTART_COUNT=1): starting 2 worker(s) again" in out
    want = _local([rt.global_batch(job.x, job.y, 2, s) for s in range(rt.STEPS)])
    for w in range(2):
        models.assert_weights_close(dict(np.load(str(tmp_path / ("worker_%d.npz" % w)))),
                                    want)
    _nothing_left(tmp_path, out0 + out1)
    for r, out in enumerate((out0, out1)):
        ran = rt.STEPS - _restored_step(out, 1, r)
        table = out[out.index("epl-launch progress"):].splitlines()
        rows = [line.split() for line in table[2:] if line.strip()]
        assert len(rows) == 1 and rows[0][:2] == [str(r), str(ran)] and rows[0][-1] == "0", \
            table
        records = [json.loads(line) for line in
                   (tmp_path / ("progress%d.json" % r)).read_text().splitlines()]
        runs = re.findall(r"epl-launch: attempt (\d+): run ([0-9a-f]+)", out)
        assert [(int(k), run) for k, run in runs] == [
            (x["attempt"], x["run_id"]) for x in records if x["type"] == "attempt"] and \
            [k for k, _ in runs] == ["0", "1"], (runs, records)
        assert set(x["worker"] for x in records if x["type"] == "status") == {r}
        assert records[-1]["type"] == "summary", records[-1]
        row, = records[-1]["workers"]
        assert (row["worker"], row["steps"], row["step"], row["exit_status"]) == \
            (r, ran, rt.STEPS, 0), row


def test_a_machine_that_stays_away_is_dropped(tmp_path):
    """Machine 1's launcher is killed (SIGKILL, its worker goes with it) while its worker
    waits after step 5, and does not come back within --host_timeout 3: under
    --min_workers 1 machine 0 goes on alone from the newest checkpoint (step 5), and the
    numbers follow the documented rule, as on one machine."""
    import signal
    job = _Launchers(tmp_path, ["--max_restarts", "1", "--min_workers", "1",
                                "--host_timeout", "3"], {"RESTART_PAUSE": "1:5"})
    job.wait_for(1, "worker 1 paused at step 5")
    job.procs[1].send_signal(signal.SIGKILL)
    codes = job.finish()
    out = job.out(0)
    assert codes == [0, -signal.SIGKILL], out[-6000:]
    assert "machine 1 (127.0.0.3): its launcher went away" in out, out[-6000:]
    assert "machine 1 (127.0.0.3) did not come back within --host_timeout 3s: dropped for " \
           "good; the job goes on with 1 worker(s) (--min_workers 1): worker 0 is rank 0" \
           in out, out[-6000:]
    assert "attempt 1: worker 0 of 1 starts at global step 5" in out, out[-6000:]
    want = _local([rt.global_batch(job.x, job.y, 2, s) for s in range(5)] +
                  [rt.global_batch(job.x, job.y, 1, s) for s in range(5, rt.STEPS)])
    models.assert_weights_close(dict(np.load(str(tmp_path / "worker_0.npz"))), want)
    _nothing_left(tmp_path, out)


def test_the_coordinator_drops_a_worker_that_stays_down(tmp_path):
    """test_a_worker_that_stays_down_is_dropped across machines: worker 1 (machine 1) is
    killed after step 5, then fails at start-up in the restarted attempt; under
    --min_workers 1 the coordinator drops it as the one-machine launcher does (the same
    restart rule), lets machine 1's launcher go (none of its workers takes part), and
    worker 0 finishes alone from the newest checkpoint with the documented numbers."""
    job = _Launchers(tmp_path, ["--max_restarts", "2", "--min_workers", "1",
                                "--host_timeout", "60"],
                     {"RESTART_KILL": "1:5", "RESTART_DOWN": "1"})
    codes = job.finish()
    out0, out1 = job.out(0), job.out(1)
    assert codes == [0, 1], out0[-6000:] + out1[-6000:]
    assert "worker 1: its host is down" in out1, out1[-6000:]
    assert "attempt 1 failed after" in out0 and \
        "machine 1 (127.0.0.3): worker 1 exited with status 3" in out0, out0[-6000:]
    assert "worker 1 failed again at start-up (before it joined the job): dropped for " \
           "good; the job goes on with 1 worker(s) (--min_workers 1): worker 0 is rank 0" \
           in out0, out0[-6000:]
    assert "restart 2 of 2 (EPL_RESTART_COUNT=2): starting 1 worker(s) again" in out0
    assert "machine 1 was dropped from the job: none of its workers takes part" in out1, \
        out1[-3000:]
    start = _restored_step(out0, 2)
    assert 1 <= start <= 5, start
    assert "attempt 2: worker 0 of 1 starts at global step %d" % start in out0
    want = _local([rt.global_batch(job.x, job.y, 2, s) for s in range(start)] +
                  [rt.global_batch(job.x, job.y, 1, s) for s in range(start, rt.STEPS)])
    models.assert_weights_close(dict(np.load(str(tmp_path / "worker_0.npz"))), want)
    _nothing_left(tmp_path, out0 + out1)


def test_a_machine_whose_launcher_comes_back_rejoins(tmp_path):
    """Machine 1's launcher is killed while its worker waits after step 5, and started
    again (same command line) within --host_timeout: both machines restart from step 5,
    and the weights equal the uninterrupted run's."""
    import signal
    job = _Launchers(tmp_path, ["--max_restarts", "1", "--min_workers", "1",
                                "--host_timeout", "60"], {"RESTART_PAUSE": "1:5"})
    job.wait_for(1, "worker 1 paused at step 5")
    job.procs[1].send_signal(signal.SIGKILL)
    job.procs[1].wait()
    job.start(1)
    codes = job.finish()
    out0, out1 = job.out(0), job.out(1)
    assert codes == [0, 0], out0[-5000:] + out1[-5000:]
    assert "machine 1 (127.0.0.3): its launcher went away" in out0, out0[-5000:]
    assert "dropped" not in out0
    assert "restart 1 of 1 (EPL_RESTART_COUNT=1): starting 2 worker(s) again" in out1, out1
    assert "attempt 1: worker 1 of 2 starts at global step 5" in out1, out1[-5000:]
    want = _local([rt.global_batch(job.x, job.y, 2, s) for s in range(rt.STEPS)])
    for w in range(2):
        models.assert_weights_close(dict(np.load(str(tmp_path / ("worker_%d.npz" % w)))),
                                    want)
    _nothing_left(tmp_path, out0 + out1)


def test_a_launcher_with_another_secret_is_refused(tmp_path):
    """The coordinator obeys only launchers that prove the job's secret: machine 1's
    launcher with another EPL_JOB_SECRET is refused (and logged); it gives up, and machine
    0's ends the job naming the machine that never connected, both within the
    --host_timeout (no worker ever starts)."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    machines = _machines(2)
    procs = []
    for r, secret in ((0, "the-job-secret"), (1, "another-secret")):
        env = dict(os.environ, PYTHONPATH=ROOT, EPL_JOB_SECRET=secret)
        env.pop("EPL_JOB_ID", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "epl.launch", "--num_workers", "2", "--machine_list",
             machines, "--machine_rank", str(r), "--max_restarts", "1", "--host_timeout", "4",
             "--log_dir", str(tmp_path / ("logs%d" % r)), str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0].decode())
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a launcher hung")
    assert procs[0].returncode == 1 and procs[1].returncode == 1, outs
    assert "refused a connection from" in outs[0] and \
        "does not prove the job's secret" in outs[0], outs[0]
    assert "launcher of machine(s) [1] did not connect" in outs[0], outs[0]
    assert "is EPL_JOB_SECRET the same on every machine?" in outs[1], outs[1]
    assert "a worker started" not in "".join(outs)


SLEEPER = """import os, sys, time
attempt = int(os.environ["EPL_RESTART_COUNT"])
rank = os.environ["EPL_WORKER_INDEX"]
open(os.path.join(sys.argv[1], "pid_%d_%s" % (attempt, rank)), "w").write(str(os.getpid()))
print("worker %s sleeps" % rank, flush=True)
time.sleep(300)
"""


def test_sigterm_ends_a_restarting_job_on_every_machine(tmp_path):
    """SIGTERM (a scheduler stopping the job) is never restarted: on one machine the
    launcher stops its workers and ends; across machines, machine 1's launcher tells the
    coordinator, and machine 0's ends too, naming it."""
    import signal
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = dict(os.environ, PYTHONPATH=ROOT, EPL_JOB_SECRET="the-job-secret")
    env.pop("EPL_JOB_ID", None)

    def start(args, log):
        return subprocess.Popen([sys.executable, "-m", "epl.launch", "--num_workers", "2",
                                 "--max_restarts", "3", "--log_dir", str(tmp_path / log)] +
                                args + [str(script), str(tmp_path)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_for_pids(count):
        deadline = time.time() + 90
        while len(list(tmp_path.glob("pid_*"))) < count:
            assert time.time() < deadline, "the workers did not start"
            time.sleep(0.1)

    one = start([], "logs")
    wait_for_pids(2)
    one.send_signal(signal.SIGTERM)
    out = one.communicate(timeout=60)[0].decode()
    assert one.returncode == 1 and "terminated (SIGTERM); stopped all workers." in out, out
    assert "restart 1" not in out
    _nothing_left(tmp_path, out)
    for p in tmp_path.glob("pid_*"):
        p.unlink()
    machines = _machines(2)
    two = [start(["--machine_list", machines, "--machine_rank", str(r)], "logs%d" % r)
           for r in (0, 1)]
    wait_for_pids(2)
    two[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=60)[0].decode() for p in two]
    assert [p.returncode for p in two] == [1, 1], outs
    assert "machine 1's launcher was terminated (SIGTERM); stopped all workers." in outs[0], \
        outs[0]
    assert "restart 1" not in "".join(outs)
    _nothing_left(tmp_path, "".join(outs))
