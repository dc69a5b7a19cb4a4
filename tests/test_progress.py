"""Live progress (epl.runtime.progress, epl.launch.display) and EPL's TensorBoard scalars.

The oracles: the steps a job ran, the losses its program fetched and printed, the global
batch from the job's shape, the bytes of the model's gradients from its variables'
sizes, and samples/s = steps/s x global batch in every record.
"""
import glob
import io
import json
import os
import subprocess
import sys
import time

import pytest
import tensorflow.compat.v1 as tf

from epl.runtime import progress
from epl.launch.display import ProgressDisplay
from tests import models
from tests.mw_progress import BATCH, STEPS

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The gradients of models.forward: float32, one per variable.
GRADIENT_BYTES = 4 * (models.IN * models.HIDDEN + models.HIDDEN
                      + models.HIDDEN * models.CLASSES + models.CLASSES)


def _launch(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("EPL_JOB_ID", None)
    try:
        out = subprocess.run([sys.executable, "-m", "epl.launch"] + args, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail("epl-launch hung:\n%s" % (e.output or b"").decode()[-5000:])
    return out.returncode, out.stdout.decode()


def _scalars(folder):
    """{tag: [(step, value)]} of the epl/ scalars in the event files of ``folder``."""
    out = {}
    for path in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        for event in tf.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag.startswith("epl/"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_two_worker_launch_reports_progress_json_and_tensorboard(tmp_path):
    workers, devices = 2, 2
    log_json = tmp_path / "progress.json"
    code, out = _launch(["--num_workers", str(workers), "--gpu_per_worker", str(devices),
                         "--log_dir", str(tmp_path / "logs"), "--log_json", str(log_json),
                         os.path.join(HERE, "mw_progress.py"), str(tmp_path), "summaries"])
    assert code == 0, out[-5000:]
    # Status lines (stdout is a pipe: plain lines) and the summary table.
    for w in range(workers):
        assert "[progress] worker %d: step " % w in out, out[-5000:]
    table = out[out.index("epl-launch progress"):].splitlines()[2:2 + workers]
    for w, row in enumerate(table):
        cells = row.split()
        assert cells[0] == str(w) and cells[1] == str(STEPS) and cells[-1] == "0", table

    # What each worker's program fetched: (global_step after the run, loss).
    fetched = {}
    for line in out.splitlines():
        if "LOSSES " in line:
            w = int(line.split("[worker ")[1].split("]")[0])
            fetched[w] = dict((s, l) for s, l in json.loads(line.split("LOSSES ", 1)[1]))
    assert sorted(fetched) == list(range(workers)), out[-5000:]

    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    status = [r for r in records if r["type"] == "status"]
    summary = [r for r in records if r["type"] == "summary"]
    assert len(summary) == 1 and records[-1]["type"] == "summary"
    global_batch = BATCH * devices * workers
    for w in range(workers):
        mine = [r for r in status if r["worker"] == w]
        # the first step, at least one in between (steps take PAUSE s; a sample every
        # 0.5 s), the last: fewer samples than steps
        assert 3 <= len(mine) < STEPS, mine
        assert mine[-1]["final"] and mine[-1]["runs"] == STEPS and mine[-1]["step"] == STEPS
        for r in mine:
            assert r["global_batch"] == global_batch
            assert r["loss"] == fetched[w][r["step"]], (r, fetched[w])
            assert r["gradient_bytes_per_step"] == GRADIENT_BYTES
            n = workers * devices
            assert r["comm_bytes_per_step"] == pytest.approx(GRADIENT_BYTES * 2.0 * (n - 1) / n)
            if r["steps_per_sec"] is None:
                assert r is mine[0] and r["samples_per_sec"] is None
            else:
                assert r["samples_per_sec"] == pytest.approx(r["steps_per_sec"] * global_batch)
                assert r["step_time_s"] == pytest.approx(1.0 / r["steps_per_sec"])
                # a step takes at least the program's pause between steps
                assert r["steps_per_sec"] < 1.0 / 0.2
        row = [x for x in summary[0]["workers"] if x["worker"] == w][0]
        assert row["steps"] == STEPS and row["exit_status"] == 0
        assert row["loss"] == fetched[w][STEPS]
        assert row["samples_per_sec"] == pytest.approx(row["mean_steps_per_sec"] * global_batch)

    # TensorBoard: the chief's summary folder holds the epl/ scalars at the samples' steps.
    scalars = _scalars(str(tmp_path / "model_0"))
    chief = [r for r in status if r["worker"] == 0 and not r["final"]]
    steps = [r["step"] for r in chief]
    assert sorted(s for s, _ in scalars["epl/gradient_bytes_per_step"]) == steps
    assert all(v == GRADIENT_BYTES for _, v in scalars["epl/gradient_bytes_per_step"])
    assert all(v == pytest.approx(GRADIENT_BYTES * 1.5)
               for _, v in scalars["epl/comm_bytes_per_step"])
    rated = dict((r["step"], r) for r in chief if r["steps_per_sec"] is not None)
    assert sorted(s for s, _ in scalars["epl/samples_per_sec"]) == sorted(rated)
    for s, v in scalars["epl/samples_per_sec"]:
        assert v == pytest.approx(rated[s]["samples_per_sec"], rel=1e-6)
    for s, v in scalars["epl/step_time_s"]:
        assert v == pytest.approx(rated[s]["step_time_s"], rel=1e-6)
    # only the chief writes summaries
    assert not _scalars(str(tmp_path / "model_1"))


def _fed_program():
    """A 2-device program fed through placeholders, with a global_step."""
    models.init_data_parallel(2)
    x = tf.placeholder(tf.float32, [None, models.IN])
    y = tf.placeholder(tf.int64, [None])
    _, loss = models.forward(x, y)
    step = tf.train.get_or_create_global_step()
    return x, y, loss, step, models.train_op(loss, "sgd", step)


def test_a_worker_records_its_steps_and_fetched_loss(tmp_path, monkeypatch):
    """Only training runs count (not an evaluation fetching the loss alone); the loss is
    the one fetched, wherever it sits in the fetches; samples are rate-limited."""
    monkeypatch.setenv("EPL_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("EPL_WORKER_INDEX", "0")
    monkeypatch.setattr(progress, "_TRACKER", [])
    x, y, loss, step, train = _fed_program()
    bx, by = models.data(8 * 20)
    fetched = []
    start = time.time()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(20):
            feed = {x: bx[8 * i:8 * i + 8], y: by[8 * i:8 * i + 8]}
            got = sess.run({"out": [loss], "train": train}, feed)
            fetched.append(float(got["out"][0]))
            sess.run(loss, feed)   # an evaluation: not a step
        elapsed = time.time() - start
        progress.tracker().finish()
    progress.tracker().path = None   # (no second final record at exit)
    lines = (tmp_path / "worker_0.progress.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert 2 <= len(records) <= 2 + elapsed / progress.INTERVAL, records
    first, last = records[0], records[-1]
    assert first["runs"] == 1 and first["step"] == 1 and first["loss"] == fetched[0]
    assert last["final"] and last["runs"] == 20 and last["step"] == 20
    assert last["loss"] == fetched[-1]
    assert all(r["global_batch"] == 8 for r in records)   # the fed rows (one worker)


def test_nothing_without_epl_launch_or_summaries(tmp_path, monkeypatch):
    """Outside epl-launch, without a summary writer: no file, no analysis of the runs."""
    monkeypatch.delenv("EPL_LAUNCH_DIR", raising=False)
    monkeypatch.setattr(progress, "_TRACKER", [])
    monkeypatch.chdir(tmp_path)
    x, y, loss, step, train = _fed_program()
    bx, by = models.data(8)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            sess.run([loss, train], {x: bx, y: by})
    t = progress.tracker()
    assert t.path is None and t.writer is None
    assert t.runs == 0 and not t.facts
    assert not glob.glob(str(tmp_path / "**" / "*.progress.jsonl"), recursive=True)


def _write(folder, worker, **fields):
    record = dict(worker=worker, runs=1, step=1, steps_per_sec=None, samples_per_sec=None,
                  mean_steps_per_sec=None, global_batch=4, loss=None, final=False)
    record.update(fields)
    with open(os.path.join(str(folder), "worker_%d.progress.jsonl" % worker), "a") as f:
        f.write(json.dumps(record) + "\n")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_display_redraws_in_place_on_a_terminal(tmp_path):
    out = _Tty()
    display = ProgressDisplay(str(tmp_path), [0, 1], stream=out, interval=0)
    _write(tmp_path, 0, loss=2.5)
    _write(tmp_path, 1, loss=2.25)
    display.poll()
    first = out.getvalue()
    assert "worker 0: step 1" in first and "worker 1: step 1" in first and "\x1b[" not in first
    _write(tmp_path, 0, runs=5, step=5, steps_per_sec=4.0, samples_per_sec=16.0, loss=1.5)
    display.poll()
    again = out.getvalue()[len(first):]
    assert again.startswith("\x1b[2A\r\x1b[J")   # up over the two lines, cleared, redrawn
    assert "worker 0: step 5  4.00 steps/s  16.0 samples/s  loss 1.5" in again
    display.out.write("[worker 1] a line of the program\n")   # erases the block first
    assert out.getvalue().endswith("\x1b[2A\r\x1b[J[worker 1] a line of the program\n")
    display.poll()   # nothing new: not redrawn
    assert out.getvalue().endswith("program\n")


def test_display_plain_lines_summary_and_log_json(tmp_path):
    out = io.StringIO()
    log = tmp_path / "log.json"
    display = ProgressDisplay(str(tmp_path), [0, 1], stream=out, log_json=str(log))
    assert not display.tty and display.interval == 10.0
    _write(tmp_path, 0)
    display.poll()
    _write(tmp_path, 0, runs=7, step=7, steps_per_sec=2.0, samples_per_sec=8.0,
           mean_steps_per_sec=2.5, loss=0.75, final=True)
    display.poll()                      # within the interval: not printed yet
    assert out.getvalue().count("[progress]") == 1
    display.poll(final=True)            # the end of the job: printed
    assert out.getvalue().count("[progress]") == 2 and "(done)" in out.getvalue()
    rows = display.summary({0: 0, 1: 1})
    assert rows == [{"worker": 0, "steps": 7, "step": 7, "mean_steps_per_sec": 2.5,
                     "samples_per_sec": 10.0, "global_batch": 4, "loss": 0.75,
                     "exit_status": 0}]
    table = out.getvalue().split("epl-launch progress")[1].splitlines()
    assert table[1].split() == ["worker", "steps", "steps/s", "samples/s", "last", "loss", "exit"]
    assert table[2].split() == ["0", "7", "2.50", "10.0", "0.75", "0"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["type"] for r in records] == ["status", "status", "summary"]
    assert records[-1]["workers"] == rows


@pytest.mark.estimator
def test_an_estimator_gets_the_scalars_in_its_model_dir(tmp_path):
    """The Estimator's own summary writer (model_dir) receives EPL's scalars; the first
    step is always sampled."""
    models.init_data_parallel(2)
    bx, by = models.data(8 * 6)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((bx, by)).batch(8).repeat()

    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        return tf.estimator.EstimatorSpec(
            mode, loss=loss, train_op=models.train_op(loss, "sgd", tf.train.get_global_step()))
    est = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path / "est"))
    est.train(input_fn, steps=3)
    scalars = _scalars(str(tmp_path / "est"))
    assert scalars["epl/gradient_bytes_per_step"][0] == (1, GRADIENT_BYTES)
    assert scalars["epl/comm_bytes_per_step"][0] == (1, GRADIENT_BYTES)   # 2 ranks: x 1


def test_keras_fit_steps_and_loss(tmp_path, monkeypatch):
    """tf.keras trains through session callables: each batch is a step, its loss the one
    keras reports for the batch (a model without global_step: the steps are counted)."""
    monkeypatch.setenv("EPL_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("EPL_WORKER_INDEX", "0")
    monkeypatch.setattr(progress, "_TRACKER", [])
    models.init_data_parallel(2)
    x, y = models.data(64)
    model = tf.keras.Sequential([tf.keras.layers.Dense(models.HIDDEN, activation="tanh",
                                                       input_shape=(models.IN,)),
                                 tf.keras.layers.Dense(models.CLASSES)])
    model.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    seen = []
    log_loss = tf.keras.callbacks.LambdaCallback(
        on_batch_end=lambda batch, logs: seen.append(float(logs["loss"])))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[log_loss])
    model.evaluate(x, y, batch_size=8, verbose=0)   # not steps
    progress.tracker().finish()
    progress.tracker().path = None
    records = [json.loads(line) for line in
               (tmp_path / "worker_0.progress.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    assert first["runs"] == first["step"] == 1 and first["loss"] == seen[0]
    assert last["final"] and last["runs"] == last["step"] == 16 and last["loss"] == seen[-1]
    assert all(r["global_batch"] == 8 and r["gradient_bytes_per_step"] == GRADIENT_BYTES
               for r in records)


def test_display_follows_a_restarted_attempt(tmp_path):
    first, second = tmp_path / "a0", tmp_path / "a1"
    first.mkdir()
    second.mkdir()
    out = io.StringIO()
    display = ProgressDisplay(str(first), [0], stream=out, interval=0)
    _write(first, 0, runs=5, step=5)
    display.poll()
    display.follow(str(second))
    _write(second, 0, runs=2, step=7, final=True)   # resumed from the step-5 checkpoint
    display.poll(final=True)
    assert display.latest[0]["step"] == 7
    assert display.summary({0: 0})[0]["steps"] == 2


def test_pipeline_global_batch_and_ranks(tmp_path, monkeypatch):
    """2 stages x 2 replicas, 2 micro-batches of 3 rows: a step takes 3 x 2 x 2 rows; the
    gradients are reduced over the 2 replicas' devices (a replica's micro-batches are
    summed on its own devices)."""
    from tests.test_pipeline import _staged_forward
    monkeypatch.setenv("EPL_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("EPL_WORKER_INDEX", "0")
    monkeypatch.setattr(progress, "_TRACKER", [])
    import epl
    epl.init(epl.Config({"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2}))
    x, y = models.data(3 * 2 * 2 * 3)
    bx, by = models.input_batch(x, y, 3)
    loss = _staged_forward(bx, by, 2)
    train = models.train_op(loss, "sgd")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            sess.run([loss, train])
        progress.tracker().finish()
    progress.tracker().path = None
    records = [json.loads(line) for line in
               (tmp_path / "worker_0.progress.jsonl").read_text().splitlines()]
    assert records[-1]["runs"] == records[-1]["step"] == 3   # no global_step: the runs
    for r in records:
        assert r["global_batch"] == 12
        assert r["gradient_bytes_per_step"] == GRADIENT_BYTES
        assert r["comm_bytes_per_step"] == GRADIENT_BYTES * 2.0 * (2 - 1) / 2


def _two_machines(tmp_path, extra_args, secret):
    """A 2-worker job of mw_progress.py on two loopback 'machines', 127.0.0.2 and
    127.0.0.3 (one worker each), one epl-launch each with its own --log_json: (the list
    of the machines, [(exit status, output)] by machine)."""
    from epl.launch.ports import free_port_block
    machines = ",".join("127.0.0.%d:%d" % (2 + m, free_port_block(3, "127.0.0.%d" % (2 + m)))
                        for m in range(2))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", EPL_JOB_SECRET=secret)
    env.pop("EPL_JOB_ID", None)
    procs, outs = [], []
    for r in (0, 1):
        outs.append(open(str(tmp_path / ("launcher%d.out" % r)), "w+b"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "epl.launch", "--num_workers", "2", "--gpu_per_worker",
             "1", "--machine_list", machines, "--machine_rank", str(r), "--log_dir",
             str(tmp_path / ("logs%d" % r)), "--log_json", str(tmp_path / ("progress%d.json" % r))]
            + extra_args + [os.path.join(HERE, "mw_progress.py"), str(tmp_path)],
            env=env, stdout=outs[-1], stderr=subprocess.STDOUT))
    deadline = time.time() + 240
    try:
        for p in procs:
            p.wait(max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
    results = []
    for p, f in zip(procs, outs):
        f.seek(0)
        results.append((p.returncode, f.read().decode("utf-8", "replace")))
        f.close()
    return machines, results


@pytest.mark.parametrize("coordinated", [False, True], ids=["plain", "max_restarts"])
def test_each_machine_shows_its_own_workers_progress(tmp_path, coordinated):
    """--machine_list, plain and under --max_restarts (machine 0's launcher coordinates):
    each machine's launcher shows the status lines and the summary row of its own worker
    (rank 1 on machine 1), whose steps are the steps it ran and whose last loss is the
    one its program fetched; --log_json parses: the attempt's run (the one printed,
    derived as epl.launch.workers says), then its worker's samples, then the summary."""
    from epl.launch.workers import job_id_of, shared_run_id
    secret = "the-secret-of-both-machines"
    machines, results = _two_machines(
        tmp_path, ["--max_restarts", "1"] if coordinated else [], secret)
    run = shared_run_id(job_id_of(machines.split(",")), secret, 0)   # (1 worker a machine)
    for r, (code, out) in enumerate(results):
        assert code == 0, out[-5000:]
        assert "epl-launch: attempt 0: run %s\n" % run in out, out[-5000:]
        assert not glob.glob("/dev/shm/epl-%s-*" % run)
        assert "[progress] worker %d: step " % r in out, out[-5000:]
        assert "[progress] worker %d:" % (1 - r) not in out, out[-5000:]
        fetched = json.loads(out.split("[worker %d] LOSSES " % r, 1)[1].splitlines()[0])
        assert [s for s, _ in fetched] == list(range(1, STEPS + 1))
        table = out[out.index("epl-launch progress"):].splitlines()
        assert table[1].split()[0] == "worker"
        rows = [line.split() for line in table[2:] if line.strip()]
        assert len(rows) == 1 and rows[0][:2] == [str(r), str(STEPS)] and \
            rows[0][4:] == ["%.6g" % fetched[-1][1], "0"], table
        records = [json.loads(line) for line in
                   (tmp_path / ("progress%d.json" % r)).read_text().splitlines()]
        assert records[0] == dict(records[0], type="attempt", attempt=0, run_id=run)
        status = records[1:-1]
        assert status and all(s["type"] == "status" and s["worker"] == r for s in status)
        assert status[-1]["final"] and status[-1]["runs"] == STEPS
        assert records[-1]["type"] == "summary"
        row, = records[-1]["workers"]
        assert (row["worker"], row["steps"], row["step"], row["exit_status"]) == \
            (r, STEPS, STEPS, 0), row
        assert row["loss"] == fetched[-1][1]


def test_the_step_that_also_checks_gradients_is_counted(tmp_path, monkeypatch):
    """gradient_checkpoint.check_gradients with an input pipeline fetches its check with
    the first training step (resource variables): that step is a step like the others."""
    monkeypatch.setenv("EPL_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("EPL_WORKER_INDEX", "0")
    monkeypatch.setattr(progress, "_TRACKER", [])
    models.init_data_parallel(1, **{"gradient_checkpoint.type": "auto",
                                    "gradient_checkpoint.check_gradients": True})
    x, y = models.data(48)
    bx, by = models.input_batch(x, y, 16)
    h = bx
    with tf.variable_scope("", use_resource=True):
        for i in range(3):   # a few layers before the model's, so there is a checkpoint
            h = tf.identity(tf.nn.relu(h) - tf.nn.relu(-h), name="pre_%d" % i)
        _, loss = models.forward(h, by, use_resource=True)
    train = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    fetched = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            fetched.append(float(sess.run([loss, train])[0]))
        progress.tracker().finish()
    progress.tracker().path = None   # (no second final record at exit)
    records = [json.loads(line) for line in
               (tmp_path / "worker_0.progress.jsonl").read_text().splitlines()]
    assert records[0]["runs"] == 1 and records[0]["loss"] == fetched[0], records
    assert records[-1]["final"] and records[-1]["runs"] == 3 and records[-1]["step"] == 3
    assert records[-1]["loss"] == fetched[-1]


def _fed_losses(steps, feeds):
    """The losses of ``steps`` training runs of ``_fed_program`` (fresh graph, EPL on 2
    devices), each fetched with the training op in one run."""
    models.reset()
    x, y, loss, step, train = _fed_program()
    out = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(steps):
            value, _, s = sess.run([loss, train, step], {x: feeds[0][i], y: feeds[1][i]})
            out.append((float(value), int(s)))
    return out


def test_a_progress_failure_never_fails_the_users_run(tmp_path, monkeypatch, caplog):
    """Progress bookkeeping runs inside every Session.run: an error in it is logged once
    (with the error) and turns progress off for that session; the user's runs go on and
    return what they return without EPL's progress (the same losses and steps)."""
    import logging
    bx, by = models.data(8 * 4)
    feeds = ([bx[8 * i:8 * i + 8] for i in range(4)], [by[8 * i:8 * i + 8] for i in range(4)])
    monkeypatch.delenv("EPL_LAUNCH_DIR", raising=False)
    monkeypatch.setattr(progress, "_TRACKER", [])
    want = _fed_losses(4, feeds)          # progress off: the oracle
    monkeypatch.setenv("EPL_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("EPL_WORKER_INDEX", "0")
    monkeypatch.setattr(progress, "_TRACKER", [])
    calls = []

    def broken(self, fetches):
        calls.append(1)
        raise RuntimeError("injected progress failure")
    monkeypatch.setattr(progress._GraphFacts, "kind", broken)
    with caplog.at_level(logging.WARNING, logger="epl"):
        got = _fed_losses(4, feeds)
    progress.tracker().path = None   # (no final record at exit)
    assert got == want
    assert len(calls) == 1, "progress was not turned off after its first error"
    warned = [r.getMessage() for r in caplog.records if "injected progress failure" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "progress" in warned[0]
