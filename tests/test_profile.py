"""profile.dir / profile.steps and ``python -m epl.profile`` (issue 28, tracing part).

The traces of a 2-worker x 2-device data-parallel job (epl-launch) and of a 2-stage,
4-micro-batch pipeline: spans on every device, each collective's bytes equal to the sizes
of the variables whose gradients it reduces, the pipeline bubble within 10% of
benchmarks/pipeline_bubble.py's own figure for the same run, the picture a valid PNG of
the size the renderer promises, and the config's errors.
"""
import json
import os
import struct
import subprocess
import sys
import zlib

import pytest

from epl.core.config import Config, parse_steps
from epl.profile import analysis, collectives, render
from tests import models

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# float32 bytes of the variables of tests/models.py (2 dense layers, kernels and biases)
MODEL_BYTES = 4 * (models.IN * models.HIDDEN + models.HIDDEN
                   + models.HIDDEN * models.CLASSES + models.CLASSES)


# -- config ----------------------------------------------------------------------------

def test_profile_keys_default_off():
    cfg = Config(environ={})
    assert cfg.get("profile.dir") == ""
    assert parse_steps(cfg.get("profile.steps")) == [10, 11, 12]
    assert parse_steps("3") == [3]
    assert parse_steps("3, 5,8-9") == [3, 5, 8, 9]


@pytest.mark.parametrize("value", ["", "a", "0", "5-3", "3-", "-2", "1-20000", "3;4"])
def test_profile_steps_errors_name_key_value_and_fix(value):
    with pytest.raises(ValueError) as e:
        Config({"profile.steps": value}, environ={})
    msg = str(e.value)
    assert "'profile.steps'" in msg and repr(value) in msg and "'10-12'" in msg, msg


def test_profile_steps_error_from_environment():
    with pytest.raises(ValueError) as e:
        Config(environ={"EPL_PROFILE_STEPS": "x"})
    assert "EPL_PROFILE_STEPS" in str(e.value) and "'profile.steps'" in str(e.value)


def test_profile_dir_must_be_a_string():
    with pytest.raises(ValueError) as e:
        Config({"profile.dir": 3}, environ={})
    assert "'profile.dir'" in str(e.value)


# -- a 2-worker x 2-device data-parallel job ---------------------------------------------

def _launch(args, env_extra, cwd, timeout=240):
    cmd = [sys.executable, "-m", "epl.launch"] + args
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **env_extra)
    env.pop("EPL_JOB_ID", None)
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        pytest.fail("epl-launch hung:\n%s" % (e.output or b"").decode()[-5000:])
    return out.returncode, out.stdout.decode()


@pytest.fixture(scope="module")
def dp_traces(tmp_path_factory):
    """tests/mw_train.py on 2 workers x 2 devices, its training step 4 traced: the step
    after the first checkpoint, where the chief has run its Saver.save (a run the other
    worker does not make), so the workers' run counts differ there."""
    work = tmp_path_factory.mktemp("dp")
    folder = str(work / "trace")
    code, out = _launch(["--num_workers", "2", "--gpu_per_worker", "2",
                         os.path.join(HERE, "mw_train.py"), str(work)],
                        {"EPL_PROFILE_DIR": folder, "EPL_PROFILE_STEPS": "4"}, str(work))
    assert code == 0, out[-5000:]
    return folder


def test_dp_one_trace_per_worker_and_traced_run(dp_traces):
    assert sorted(os.listdir(dp_traces)) == ["worker0_rewrite.trace.json",
                                             "worker0_step4.trace.json",
                                             "worker1_rewrite.trace.json",
                                             "worker1_step4.trace.json"]
    steps = analysis.load(dp_traces)
    assert list(steps) == [(1, 4)]
    assert [t.worker for t in steps[(1, 4)]] == [0, 1]


def test_dp_workers_traced_the_same_training_step(dp_traces):
    """Both workers' "step 4" is the run that took their global_step from 3 to 4 (the
    chief's Saver.save and the workers' reads of the step are not steps)."""
    for t in analysis.load(dp_traces)[(1, 4)]:
        assert (t.meta["step"], t.meta["global_step"], t.meta["training_run"]) == (4, 4, 4), \
            (t.worker, t.meta)


def test_dp_spans_on_every_device(dp_traces):
    traces = analysis.load(dp_traces)[(1, 4)]
    lanes = [(t.worker, name, lane) for t in traces for name, lane in t.lanes.items()]
    assert sorted(name for _, name, _ in lanes) == [
        "worker %d device:CPU:%d" % (w, d) for w in (0, 1) for d in (0, 1)]
    for worker, name, lane in lanes:
        assert lane["ops"], name
        assert lane["collectives"], name
        # every device runs one replica: its forward and its backward
        phases = sorted(set(e["args"]["phase"] for e in lane["stages"]))
        assert phases == ["backward", "forward"], (name, phases)
        replicas = set(e["args"]["replica"] for e in lane["stages"])
        assert len(replicas) == 1, (name, replicas)
        for e in lane["collectives"]:
            a = e["args"]
            assert a["wait_us"] >= 0 and a["move_us"] >= 0
            assert a["wait_us"] + a["move_us"] == e["dur"]
            assert a["peers"] == 2


def test_dp_collective_bytes_are_the_variables_sizes(dp_traces):
    """Every worker reduces its 2 devices' gradients in process (each rank gives the
    gradients of every variable once), then across the workers (one rank per worker)."""
    runs = analysis.collectives(analysis.load(dp_traces)[(1, 4)])
    for worker in (0, 1):
        mine = [r for r in runs if r["worker"] == worker]
        for rank in (0, 1):
            local = [r for r in mine if r["transport"] == "inprocess" and r["rank"] == rank]
            assert sum(r["bytes"] for r in local) == MODEL_BYTES, local
        cross = [r for r in mine if r["transport"] == "shm"]
        assert sum(r["bytes"] for r in cross) == MODEL_BYTES, cross
        assert set(r["rank"] for r in cross) == {worker}
    # the two workers' ranks of each cross-worker run agree on the bytes
    by_group = {}
    for r in runs:
        if r["transport"] == "shm":
            by_group.setdefault(r["group"], set()).add((r["worker"], r["bytes"]))
    for group, seen in by_group.items():
        assert len(seen) == 2 and len(set(b for _, b in seen)) == 1, (group, seen)


def test_dp_breakdown_adds_up_and_clocks_agree(dp_traces):
    traces = analysis.load(dp_traces)[(1, 4)]
    lanes = analysis.breakdown(traces)
    assert len(lanes) == 4
    for ln in lanes:
        parts = (ln.compute_us, ln.comm_us, ln.hidden_us, ln.exposed_us, ln.wait_us,
                 ln.idle_us)
        assert min(parts) >= 0, ln
        assert ln.hidden_us + ln.exposed_us == ln.comm_us, ln
        assert ln.compute_us + ln.exposed_us + ln.wait_us + ln.idle_us == ln.window_us, ln
        assert ln.compute_us > 0 and ln.comm_us > 0, ln
    # One host: one clock.  The estimate from the shared collectives must say so, to
    # within what a loaded 2-core machine takes to pass a message.
    offsets = analysis.clock_offsets(traces)
    assert offsets[0] == 0 and abs(offsets[1]) < 50000, offsets


def test_dp_rewrite_passes_traced_once(dp_traces):
    from epl import rewrite
    for worker in (0, 1):
        with open(os.path.join(dp_traces, "worker%d_rewrite.trace.json" % worker)) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "epl.rewrite"]
        assert [e["name"] for e in events] == rewrite.PASSES.names()
        assert all(e["dur"] >= 0 for e in events)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(events, events[1:]))


# -- a 2-stage, 4-micro-batch pipeline ---------------------------------------------------

@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """benchmarks/pipeline_bubble.py's model (2 stages of 50 ms per micro-batch each way,
    4 micro-batches, 1F1B) measured by the benchmark itself on its 3rd run (its 2nd
    training step: the first run initializes), which EPL traces at the same time (the benchmark passes its own RunOptions and RunMetadata: EPL
    merges its full trace with them)."""
    folder = str(tmp_path_factory.mktemp("pipe"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    saved = {k: os.environ.get(k) for k in ("EPL_PROFILE_DIR", "EPL_PROFILE_STEPS")}
    os.environ.update(EPL_PROFILE_DIR=folder, EPL_PROFILE_STEPS="2")
    try:
        import pipeline_bubble
        models.reset()
        figure = pipeline_bubble.measure(2, 4, "PreferBackward", 0.05)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
        models.reset()
    return folder, figure


def test_pipeline_only_the_named_run_is_traced(pipeline_run):
    folder, _ = pipeline_run
    assert sorted(os.listdir(folder)) == ["worker0_rewrite.trace.json",
                                          "worker0_step2.trace.json"]


def test_pipeline_stage_spans_on_every_device(pipeline_run):
    folder, _ = pipeline_run
    (trace,) = analysis.load(folder)[(1, 2)]
    assert list(trace.lanes) == ["worker 0 device:CPU:0", "worker 0 device:CPU:1"]
    for stage, lane in enumerate(trace.lanes.values()):
        assert set(e["args"]["stage"] for e in lane["stages"]) == {stage}
        tasks = set((e["args"]["phase"], e["args"]["micro_batch"]) for e in lane["stages"])
        assert tasks == set((p, m) for p in ("forward", "backward") for m in range(4)), tasks
        names = set(e["name"] for e in lane["stages"])
        assert "S%d F0" % stage in names and "S%d B3" % stage in names


def test_pipeline_bubble_matches_the_benchmark(pipeline_run):
    folder, figure = pipeline_run
    (bubble,) = analysis.bubbles(analysis.load(folder)[(1, 2)])
    assert (bubble.stages, bubble.micro_batches) == (2, 4)
    assert bubble.theory == pytest.approx(1.0 / 5)
    assert abs(bubble.bubble - figure["bubble"]) <= 0.1 * figure["bubble"], (bubble, figure)
    # each stage ran 4 forwards and 4 backwards of 50 ms
    for busy in bubble.busy_us:
        assert 0.4e6 <= busy <= 0.5e6, bubble


def test_pipeline_ops_name_their_task(pipeline_run):
    """Every sleep op of the traced step says which stage, micro-batch and phase it ran."""
    folder, _ = pipeline_run
    (trace,) = analysis.load(folder)[(1, 2)]
    sleeps = [e["args"] for lane in trace.lanes.values() for e in lane["ops"]
              if "sleep_" in e["args"]["name"]]
    assert sorted((a["stage"], a["phase"], a["micro_batch"]) for a in sleeps) == sorted(
        (s, p, m) for s in range(2) for p in ("forward", "backward") for m in range(4))


def _two_stage_trace(folder, tagged):
    """Step 1 of a 2-stage, 1-micro-batch pipeline: stage 0's forward is a 10 us shape op,
    then 4 ms idle (a late wake-up), then its 50 ms op; stage 1 runs a collective that
    waits 30 ms for its peer, then moves for 20 ms.  The stage lane closes the 4 ms gap
    as the recorder does (1% of the run).  ``tagged``: the ops name their task."""
    events = []
    for pid in (1, 2):
        events.append(dict(ph="M", name="process_name", pid=pid,
                           args=dict(name="worker 0 device:CPU:%d" % (pid - 1))))

    def op(pid, name, ts, dur, stage):
        args = dict(name=name, op=name)
        if tagged:
            args.update(replica=0, stage=stage, micro_batch=0, phase="forward")
        events.append(dict(ph="X", cat="op", name=name, pid=pid, tid=1, ts=ts, dur=dur,
                           args=args))

    def task(pid, ts, dur, stage):
        events.append(dict(ph="X", cat="epl.stage", name="S%d F0" % stage, pid=pid, tid=3,
                           ts=ts, dur=dur, args=dict(replica=0, stage=stage, micro_batch=0,
                                                     phase="forward")))
    op(1, "shape", 0, 10, 0)
    op(1, "work", 4010, 50000, 0)
    task(1, 0, 54010, 0)
    op(2, "gather", 54010, 50000, 1)
    task(2, 54010, 50000, 1)
    events.append(dict(ph="X", cat="epl.collective", name="all_gather", pid=2, tid=2,
                       ts=54010, dur=50000, args=dict(
                           node="gather", op="all_gather(float)", group="g", transport="local",
                           rank=0, peers=2, bytes=64, wait_us=30000, move_us=20000)))
    doc = dict(traceEvents=events, otherData=dict(worker=0, step=1, num_stages=2,
                                                  num_micro_batch=1))
    with open(os.path.join(folder, "worker0_step1.trace.json"), "w") as f:
        json.dump(doc, f)


def test_bubble_counts_the_ops_own_time_not_the_stage_lane(tmp_path):
    """A stage is busy while its ops run: not in a gap the stage lane closes for the eye,
    not while a collective waits for its peer."""
    _two_stage_trace(str(tmp_path), tagged=True)
    (bubble,) = analysis.bubbles(analysis.load(str(tmp_path))[(1, 1)])
    assert bubble.busy_us == [50010, 20000]
    assert bubble.makespan_us == 104010
    assert bubble.bubble == pytest.approx(1 - 35005.0 / 104010)


def test_bubble_of_a_trace_whose_ops_name_no_task_reads_the_stage_lane(tmp_path):
    _two_stage_trace(str(tmp_path), tagged=False)
    (bubble,) = analysis.bubbles(analysis.load(str(tmp_path))[(1, 1)])
    assert bubble.busy_us == [54010, 50000]


def test_report_and_png(pipeline_run, tmp_path):
    folder, _ = pipeline_run
    text = analysis.report(folder)
    assert "worker 0 device:CPU:1" in text and "bubble" in text and "theory" in text
    out = subprocess.run([sys.executable, "-m", "epl.profile", folder, "--png",
                          str(tmp_path / "p.png")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout.decode()[-3000:]
    assert b"pipeline replica 0" in out.stdout
    width, height = _check_png(str(tmp_path / "p.png"))
    assert (width, height) == render.image_size(2)


def _check_png(path):
    """(width, height) of a valid 8-bit RGB PNG: signature, chunk CRCs, image bytes."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, []
    while at < len(data):
        (n,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + n]
        (crc,) = struct.unpack(">I", data[at + 8 + n:at + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        at += 12 + n
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    return width, height


def test_empty_folder_is_an_error_that_says_what_to_set(tmp_path):
    with pytest.raises(ValueError) as e:
        analysis.load(str(tmp_path))
    assert "profile.dir" in str(e.value)


# -- off by default ----------------------------------------------------------------------

def test_no_profile_keys_no_trace_no_records(tmp_path):
    """Without profile.dir nothing is traced: no file, the collectives record nothing,
    and a user's RunMetadata stays as the user asked (empty without a trace level)."""
    import tensorflow.compat.v1 as tf
    models.reset()
    try:
        os.chdir(str(tmp_path))
        models.init_data_parallel(2)
        x, y = models.data(32)
        bx, by = models.input_batch(x, y, 4)
        _, loss = models.forward(bx, by)
        op = models.train_op(loss, "sgd")
        collectives.take()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            meta = tf.RunMetadata()
            for _ in range(3):
                sess.run(op, run_metadata=meta)
        assert not meta.step_stats.dev_stats
        assert collectives.take() == []
        assert os.listdir(str(tmp_path)) == []
    finally:
        os.chdir(ROOT)
        models.reset()


def _small_dp_graph_runs(runs, metadata=None):
    import tensorflow.compat.v1 as tf
    with tf.Graph().as_default():
        models.init_data_parallel(2)
        x, y = models.data(32)
        bx, by = models.input_batch(x, y, 4)
        _, loss = models.forward(bx, by)
        op = models.train_op(loss, "sgd")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(runs - 1):
                sess.run(op, run_metadata=metadata)


def test_steps_counted_per_graph_and_user_metadata_filled(tmp_path, monkeypatch):
    """Without a global_step, training steps count from 1 in every graph; a process's
    second traced graph gets files of its own (not the first graph's, overwritten); a
    user's RunMetadata of a traced run is filled as if the user had asked for the trace."""
    import tensorflow.compat.v1 as tf
    folder = str(tmp_path / "t")
    monkeypatch.setenv("EPL_PROFILE_DIR", folder)
    monkeypatch.setenv("EPL_PROFILE_STEPS", "2")
    models.reset()
    try:
        meta = tf.RunMetadata()
        _small_dp_graph_runs(3, meta)
        assert meta.step_stats.dev_stats   # the traced run filled the user's metadata
        _small_dp_graph_runs(4)
    finally:
        models.reset()
    assert sorted(os.listdir(folder)) == [
        "worker0_graph2_rewrite.trace.json", "worker0_graph2_step2.trace.json",
        "worker0_rewrite.trace.json", "worker0_step2.trace.json"]
    steps = analysis.load(folder)
    assert sorted(steps) == [(1, 2), (2, 2)]
    assert "graph 2 step 2" in analysis.report(folder)


def _fake_trace(folder, worker, host, shift_us):
    """A worker's trace of step 1 with one op and two cross-worker collective runs whose
    peers met at 1000 us and 5000 us of worker 0's clock; this worker's clock is
    ``shift_us`` ahead."""
    lane = "worker %d device:CPU:0" % worker
    events = [dict(ph="M", name="process_name", pid=1, args=dict(name=lane)),
              dict(ph="X", cat="op", name="MatMul", pid=1, tid=1, ts=100 + shift_us, dur=800,
                   args=dict(name="m", op="MatMul"))]
    for group, ready in (("job/a", 1000), ("job/b", 5000)):
        events.append(dict(ph="X", cat="epl.collective", name="all_reduce", pid=1, tid=2,
                           ts=ready - 50 * (worker + 1) + shift_us, dur=50 * (worker + 1) + 100,
                           args=dict(node="c" + group[-1], op="all_reduce(sum, float)",
                                     group=group, transport="tcp", rank=worker, peers=2,
                                     bytes=64, wait_us=50 * (worker + 1), move_us=100)))
    doc = dict(traceEvents=events, otherData=dict(worker=worker, step=1, host=host))
    with open(os.path.join(folder, "worker%d_step1.trace.json" % worker), "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("hosts", [("a", "a"), ("a", "b")])
def test_clocks_of_other_hosts_aligned_from_shared_collectives(tmp_path, hosts):
    """Workers of one host keep their (shared) clock; a worker on another host is moved by
    the median offset at which the shared collective runs found their peers."""
    _fake_trace(str(tmp_path), 0, hosts[0], 0)
    _fake_trace(str(tmp_path), 1, hosts[1], 7000)
    traces = analysis.load(str(tmp_path))[(1, 1)]
    w1 = traces[1].lanes["worker 1 device:CPU:0"]
    assert traces[1].offset_us == 7000
    assert w1["ops"][0]["ts"] == (100 if hosts[0] != hosts[1] else 7100)


def test_keras_fit_steps_are_traced(tmp_path, monkeypatch):
    """tf.keras trains through callables: their calls count as runs and are traced, the
    replicas' forward and backward on both devices."""
    import numpy as np
    import tensorflow.compat.v1 as tf
    folder = str(tmp_path / "t")
    monkeypatch.setenv("EPL_PROFILE_DIR", folder)
    monkeypatch.setenv("EPL_PROFILE_STEPS", "1-40")
    models.reset()
    try:
        models.init_data_parallel(2)
        x, y = models.data(64)
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(models.HIDDEN, activation="tanh", input_shape=(models.IN,)),
            tf.keras.layers.Dense(models.CLASSES)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        models.reset()
    steps = analysis.load(folder)
    trained = [traces for traces in steps.values()
               if any(e["args"]["phase"] == "backward" for t in traces
                      for lane in t.lanes.values() for e in lane["stages"])]
    assert len(trained) >= 3, sorted(steps)
    (trace,) = trained[-1]
    assert sorted(trace.lanes) == ["worker 0 device:CPU:0", "worker 0 device:CPU:1"]
    for name, lane in trace.lanes.items():
        assert set(e["args"]["phase"] for e in lane["stages"]) == {"forward", "backward"}, name
        assert lane["collectives"], name


# -- training steps, not runs (issue 33 items 5 and 7) -----------------------------------

def _mts_training(folder, monkeypatch, steps, runs=None, train_steps=6, save_steps=2):
    """A 2-device data-parallel program trained ``train_steps`` steps by a
    MonitoredTrainingSession with a CheckpointSaverHook saving every ``save_steps`` steps
    (so its initialization runs and the saves are runs between the steps), profile.steps
    = ``steps``.  Returns (the losses, the training op's name)."""
    import tensorflow.compat.v1 as tf
    monkeypatch.setenv("EPL_PROFILE_DIR", os.path.join(folder, "trace"))
    monkeypatch.setenv("EPL_PROFILE_STEPS", steps)
    if runs is not None:
        monkeypatch.setenv("EPL_PROFILE_RUNS", runs)
    models.init_data_parallel(2)
    x, y = models.data(4 * 2 * train_steps)
    bx, by = models.input_batch(x, y, 4)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "sgd", step)
    hooks = [tf.train.CheckpointSaverHook(os.path.join(folder, "ckpt"), save_steps=save_steps)]
    losses = []
    with tf.train.MonitoredTrainingSession(hooks=hooks, save_checkpoint_secs=None,
                                           save_summaries_steps=None) as sess:
        for _ in range(train_steps):
            losses.append(sess.run([loss, op])[0])
    return losses, op.name


def _ran_op(trace, name):
    return any(e["args"]["name"] == name for lane in trace.lanes.values() for e in lane["ops"])


def test_monitored_session_traces_training_steps(tmp_path, monkeypatch):
    """profile.steps names training steps: with MonitoredTrainingSession and a checkpoint
    every 2 steps, "3-4" traces the 3rd and 4th training runs (global_step 2 -> 3 -> 4),
    each holding the training op and both replicas' forward and backward, in files named
    by the step; not the session's initialization runs or the saves."""
    _, train_name = _mts_training(str(tmp_path), monkeypatch, "3-4")
    folder = str(tmp_path / "trace")
    assert sorted(os.listdir(folder)) == ["worker0_rewrite.trace.json",
                                          "worker0_step3.trace.json",
                                          "worker0_step4.trace.json"]
    steps = analysis.load(folder)
    assert sorted(steps) == [(1, 3), (1, 4)]
    for (_, n), (trace,) in sorted(steps.items()):
        assert _ran_op(trace, train_name), (n, sum(len(ln["ops"]) for ln in trace.lanes.values()))
        assert (trace.meta["step"], trace.meta["global_step"], trace.meta["training_run"]) \
            == (n, n, n), trace.meta
        assert sorted(trace.lanes) == ["worker 0 device:CPU:0", "worker 0 device:CPU:1"]
        for name, lane in trace.lanes.items():
            assert set(e["args"]["phase"] for e in lane["stages"]) == {"forward", "backward"}
            assert lane["collectives"], name


def test_profile_runs_traces_initialization_runs_by_their_number(tmp_path, monkeypatch):
    """Runs that do not train are traced only when profile.runs names them (every
    Session.run of the graph, counted from 1): MonitoredTrainingSession's first run (an
    initialization: no training op) goes to worker0_run1; profile.steps' step 2 to
    worker0_step2."""
    _, train_name = _mts_training(str(tmp_path), monkeypatch, "2", runs="1", train_steps=3)
    folder = str(tmp_path / "trace")
    assert sorted(os.listdir(folder)) == ["worker0_rewrite.trace.json",
                                          "worker0_run1.trace.json",
                                          "worker0_step2.trace.json"]
    with open(os.path.join(folder, "worker0_run1.trace.json")) as f:
        meta = json.load(f)["otherData"]
    assert meta["run"] == 1 and meta["step"] is None and not meta["training"], meta
    (trace,) = analysis.load(folder)[(1, 2)]
    assert _ran_op(trace, train_name)


def test_profile_runs_key(monkeypatch):
    assert Config(environ={}).get("profile.runs") == ""
    assert Config({"profile.runs": "1-2,5"}, environ={}).get("profile.runs") == "1-2,5"
    with pytest.raises(ValueError) as e:
        Config({"profile.runs": "x"}, environ={})
    assert "'profile.runs'" in str(e.value) and "'x'" in str(e.value)


def test_steps_that_never_come_are_named_at_exit(tmp_path):
    """A job that ends before the steps profile.steps names says so when it exits: the
    key, the steps asked for and the training steps that ran."""
    script = tmp_path / "short.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "import tensorflow.compat.v1 as tf\n"
        "tf.disable_v2_behavior()\n"
        "from tests import models\n"
        "models.init_data_parallel(2)\n"
        "x, y = models.data(32)\n"
        "bx, by = models.input_batch(x, y, 4)\n"
        "_, loss = models.forward(bx, by)\n"
        "op = models.train_op(loss, 'sgd', tf.train.get_or_create_global_step())\n"
        "with tf.Session() as sess:\n"
        "    sess.run(tf.global_variables_initializer())\n"
        "    for _ in range(3):\n"
        "        sess.run(op)\n"
        "print('TRAINED')\n" % ROOT)
    env = dict(os.environ, PYTHONPATH=ROOT, EPL_PROFILE_DIR=str(tmp_path / "trace"),
               EPL_PROFILE_STEPS="10-12")
    out = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env, timeout=180, cwd=str(tmp_path))
    text = out.stdout.decode()
    assert out.returncode == 0 and "TRAINED" in text, text[-3000:]
    warned = [line for line in text.splitlines() if "profile.steps" in line]
    assert len(warned) == 1, text[-3000:]
    assert "'10-12'" in warned[0] and "1-3" in warned[0], warned[0]
    assert text.index("TRAINED") < text.index(warned[0])
    assert not os.path.exists(str(tmp_path / "trace"))
