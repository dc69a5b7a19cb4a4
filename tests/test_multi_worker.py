"""epl-launch and between-graph data parallelism across worker processes."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import models
from tests.mw_train import BATCH, STEPS

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def launch(args, timeout=240, cwd=None):
    """Run epl-launch; on failure or hang show its output."""
    cmd = [sys.executable, "-m", "epl.launch"] + args
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("EPL_JOB_ID", None)
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        pytest.fail("epl-launch hung:\n%s" % (e.output or b"").decode()[-5000:])
    return out.returncode, out.stdout.decode()


def _in_graph_job(tmp_path, devices, script, *args):
    """Run ``script args tmp_path`` on 2 workers x ``devices`` in-graph: the job ends well
    and the other worker served its devices to the chief.  Returns the output."""
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", str(devices),
                        os.path.join(HERE, script)] + list(args) + [str(tmp_path)],
                       cwd=str(tmp_path))
    assert code == 0, out[-5000:]
    assert "serves its devices" in out, out[-5000:]
    return out


def _local_oracle(workers, devices):
    x, y = models.data(STEPS * BATCH * devices * workers)
    return models.train_local(x, y, BATCH * devices * workers, STEPS, "adam")[0]


def _check_workers(tmp_path, workers, devices):
    want = _local_oracle(workers, devices)
    for w in range(workers):
        got = dict(np.load(str(tmp_path / ("worker_%d.npz" % w))))
        np.testing.assert_array_equal(got.pop("steps"), [2, 4, 6])   # global_step on every worker
        models.assert_weights_close(got, want)
    ckpts = os.listdir(str(tmp_path / "ckpt"))
    assert "checkpoint" in ckpts and any(c.startswith("model-6") for c in ckpts)


def test_two_workers_two_devices_equal_local_model(tmp_path):
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_train.py"), str(tmp_path)])
    assert code == 0, out[-5000:]
    assert "[worker 1]" in out and "epl-launch summary" in out
    assert os.path.exists(str(tmp_path / "logs" / "worker_0.log"))
    _check_workers(tmp_path, 2, 2)


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_zero_two_workers_two_devices(tmp_path, optimizer):
    """zero.level v1 on 2 workers x 2 devices: the job runs in-graph, each variable's
    optimizer state lives on one of the 4 devices (at most a quarter of the state plus
    the largest variable each); the numbers of the local model on the global batch; the
    chief's checkpoint restores into the plain program and trains on like the local
    model."""
    from tests import mw_zero
    out = _in_graph_job(tmp_path, 2, "mw_zero.py", optimizer)
    assert "chief trained" in out
    got = dict(np.load(str(tmp_path / "chief.npz"), allow_pickle=True))
    assert int(got.pop("steps")) == mw_zero.STEPS
    per_device = {}
    for _, device, size in got.pop("state"):
        per_device[device] = per_device.get(device, 0) + 4 * size
    assert len(per_device) == 4, per_device
    assert {d.split("/device:")[0][-6:] for d in per_device} == {"task:0", "task:1"}
    sizes = [4 * models.initial_weights()[k].size for k in models.initial_weights()]
    slots = 2 if optimizer == "adam" else 1
    total, largest = slots * sum(sizes), slots * max(sizes)
    assert sum(per_device.values()) >= total
    assert max(per_device.values()) <= (total / 4 + largest) * 1.01, per_device
    rows = 4 * mw_zero.BATCH
    x, y = models.data(mw_zero.STEPS * rows)
    want, _ = models.train_local(x, y, rows, mw_zero.STEPS, optimizer)
    models.assert_weights_close(got, want)
    # The checkpoint holds every variable's whole state: the plain program goes on.
    x2, y2 = models.data(2 * rows, seed=1)
    want, _ = models.train_local(np.concatenate([x, x2]), np.concatenate([y, y2]), rows,
                                 mw_zero.STEPS + 2, optimizer)
    import tensorflow.compat.v1 as tf
    with tf.Graph().as_default():
        bx, by = models.input_batch(x2, y2, rows)
        _, loss = models.forward(bx, by)
        op = models.train_op(loss, optimizer, tf.train.get_or_create_global_step())
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path / "ckpt")))
            for _ in range(2):
                sess.run(op)
            models.assert_weights_close(models.weights(sess), want)


@pytest.mark.parametrize("devices", [1, 2])
def test_pipeline_spanning_two_workers_equals_local(tmp_path, devices):
    """Stage 0 on worker 0, stage 1 on worker 1 (TF's distributed runtime): the local
    model with gradient accumulation over the micro-batches (and, with 2 devices per
    worker placed across workers, over 2 pipeline replicas)."""
    from tests import mw_pipeline as mp
    os.environ["EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE"] = "false"
    try:
        out = _in_graph_job(tmp_path, devices, "mw_pipeline.py")
    finally:
        del os.environ["EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE"]
    assert "chief trained" in out
    x, y = models.data(mp.STEPS * devices * mp.MICRO * mp.MB)
    want, _ = models.train_local(x, y, devices * mp.MICRO * mp.MB, mp.STEPS, "momentum")
    got = dict(np.load(str(tmp_path / "worker_0.npz")))
    assert int(got.pop("steps")) == mp.STEPS
    devices = [str(d) for d in got.pop("devices")]
    assert any("task:0" in d for d in devices) and any("task:1" in d for d in devices), devices
    models.assert_weights_close(got, want)
    assert any(f.startswith("model.ckpt-4") for f in os.listdir(str(tmp_path / "ckpt")))


@pytest.mark.parametrize("mode", ["hybrid", "moe", "moe_recipe_fixed"])
def test_split_across_two_workers_equals_local(tmp_path, mode):
    """epl.split(2) over 2 workers x 1 device (the seed's MoE tutorial shape), in-graph on
    TF's runtime: a replicated backbone + split head, and an MoE layer, equal the local
    model."""
    import tensorflow.compat.v1 as tf
    from tests import test_split as ts
    out = _in_graph_job(tmp_path, 1, "mw_split.py", mode)
    assert "chief finished" in out
    got = dict(np.load(str(tmp_path / ("%s.npz" % mode))))
    devices = [str(d) for d in got.pop("devices")]
    assert any("task:0" in d for d in devices) and any("task:1" in d for d in devices), devices
    with tf.Graph().as_default():
        if mode == "hybrid":
            losses, accs, weights = ts._local(ts._hybrid(ts._head_values()), tmp_path,
                                              "momentum")
            np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
            np.testing.assert_array_equal(got["accs"], accs)
            for k, v in weights.items():
                np.testing.assert_allclose(got["w/" + k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        elif mode == "moe_recipe_fixed":
            from tests import test_static_shapes as tss
            for k, v in tss.seed_moe_recipe(tmp_path).items():
                np.testing.assert_allclose(got["w/" + k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        else:
            runs = ts._moe_run(ts._moe_values(4), 4, 2, groups=2)
            np.testing.assert_allclose(got["losses"], [l for l, _ in runs], rtol=1e-5)
            np.testing.assert_allclose(got["outputs"], np.stack([o for _, o in runs]),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_multi_host_loopback(tmp_path, transport):
    """Two 'hosts' on 127.0.0.2 and 127.0.0.3, one launcher each (machine_rank 0 and 1);
    once with the transport EPL picks (shared memory: both are this machine) and once
    through the TCP ring that hosts on different machines use."""
    from epl.launch.ports import free_port_block
    # Each machine uses port .. port + 1 (TensorFlow's and EPL's): reserve both.
    p2, p3 = free_port_block(2, "127.0.0.2"), free_port_block(2, "127.0.0.3")
    machines = "127.0.0.2:%d,127.0.0.3:%d" % (p2, p3)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_JOB_SECRET="a-secret-both-machines-share")
    env.pop("EPL_JOB_ID", None)
    if transport == "tcp":
        env["EPL_COMM_TRANSPORT"] = "tcp"
    procs = [subprocess.Popen([sys.executable, "-m", "epl.launch", "--num_workers", "2",
                               "--gpu_per_worker", "1", "--machine_list", machines,
                               "--machine_rank", str(r), "--log_dir", str(tmp_path / ("logs%d" % r)),
                               os.path.join(HERE, "mw_train.py"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0].decode())
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host launch hung")
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    _check_workers(tmp_path, 2, 1)


def test_failing_worker_stops_the_job(tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text('if [ "$EPL_WORKER_INDEX" = "1" ]; then echo boom-from-worker-1; exit 1; '
                      'fi\nsleep 300\n')
    start = time.time()
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                        str(tmp_path / "logs"), str(script)], timeout=120)
    assert code != 0
    assert time.time() - start < 60
    assert "worker 1 exited with status 1" in out and "boom-from-worker-1" in out


def test_launch_timeout_names_running_worker(tmp_path):
    script = tmp_path / "slow.sh"
    script.write_text("sleep 300\n")
    code, out = launch(["--num_workers", "1", "--timeout", "2", "--log_dir",
                        str(tmp_path / "logs"), str(script)], timeout=60)
    assert code != 0 and "worker 0 still running after --timeout" in out


def test_bad_arguments():
    code, out = launch(["--num_workers", "0", "x.sh"], timeout=30)
    assert code != 0 and "--num_workers must be >= 1" in out


@pytest.mark.estimator
def test_estimator_under_epl_launch(tmp_path):
    """An Estimator script runs unchanged: RunConfig ignores the job's TF_CONFIG, the chief
    writes the checkpoint, and it equals the local model."""
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_estimator.py"),
                        str(tmp_path)])
    assert code == 0, out[-5000:]
    got = dict(np.load(str(tmp_path / "chief.npz")))
    assert got.pop("steps")[0] == STEPS
    models.assert_weights_close(got, _local_oracle(2, 2))


def test_global_merges_combine_every_worker(tmp_path):
    """GLOBAL_* fetches merge the replicas of every worker (LOCAL_* only this worker's),
    and every worker fetches the same global values."""
    workers, devices = 2, 2
    code, out = launch(["--num_workers", str(workers), "--gpu_per_worker", str(devices),
                        "--log_dir", str(tmp_path / "logs"), os.path.join(HERE, "mw_api.py"),
                        "merge", str(tmp_path)])
    assert code == 0, out[-5000:]
    got = [dict(np.load(str(tmp_path / ("merge_%d.npz" % w)))) for w in range(workers)]
    x, y = models.data(STEPS * BATCH * devices * workers)
    from tests.mw_train import worker_rows
    rows = [worker_rows(x, y, w, workers, BATCH * devices) for w in range(workers)]
    # The first step: replica d of worker w pulled batch d of that worker's rows.
    first = [wy[:BATCH * devices] for _, wy in rows]
    np.testing.assert_array_equal(got[0]["global_concat"], got[1]["global_concat"])
    assert sorted(got[0]["global_concat"].tolist()) == sorted(np.concatenate(first).tolist())
    for w in range(workers):
        assert sorted(got[w]["local_concat"].tolist()) == sorted(first[w].tolist())
    np.testing.assert_allclose(got[0]["global_mean"], got[1]["global_mean"], rtol=1e-6)
    np.testing.assert_allclose(got[0]["global_sum"], got[0]["global_mean"] * workers * devices,
                               rtol=1e-5)
    np.testing.assert_allclose(got[0]["global_mean"],
                               (got[0]["local_mean"] + got[1]["local_mean"]) / 2, rtol=1e-5)


@pytest.mark.estimator
def test_train_and_evaluate_on_two_workers(tmp_path):
    """tf.estimator.train_and_evaluate runs unchanged: both workers train, the chief
    evaluates its checkpoints; the weights equal the local model."""
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_api.py"),
                        "train_and_evaluate", str(tmp_path)])
    assert code == 0, out[-5000:]
    assert "worker 0 done (evaluated: True)" in out and "worker 1 done (evaluated: False)" in out
    got = dict(np.load(str(tmp_path / "chief.npz")))
    assert got.pop("step")[0] == STEPS
    assert 0 <= got.pop("acc")[0] <= 1 and np.isfinite(got.pop("loss")[0])
    models.assert_weights_close(got, _local_oracle(2, 1))


def test_warm_start_with_global_step_on_two_workers(tmp_path):
    """BERT's warm start across workers: ``init_from_checkpoint(ckpt, {"/": "/"})`` from a
    checkpoint holding ``global_step`` (the restores replace the initializers; worker 0's
    restored values reach every worker); equals the same program without EPL on the
    global batch, and the step continues from the checkpoint's (issue 24, item 1)."""
    import tensorflow.compat.v1 as tf
    from tests import mw_warm_start
    ckpt = str(tmp_path / "pretrained")
    with tf.Graph().as_default():
        x, y = models.data(2)
        models.forward(tf.constant(x), tf.constant(y))
        step = tf.train.get_or_create_global_step()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run([v.assign(v * 0.5 + 0.1) for v in tf.trainable_variables()]
                     + [step.assign(5)])
            tf.train.Saver().save(sess, ckpt)
    x, y = models.data(STEPS * BATCH * 2)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, BATCH * 2)
        op, step = mw_warm_start.train(bx, by, ckpt)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            want = models.weights(sess)
            assert sess.run(step) == 5 + STEPS
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "1",
                        os.path.join(HERE, "mw_warm_start.py"), ckpt, str(tmp_path)],
                       cwd=str(tmp_path))
    assert code == 0, out[-5000:]
    for w in range(2):
        got = dict(np.load(str(tmp_path / ("worker_%d.npz" % w))))
        assert got.pop("step") == 5 + STEPS
        models.assert_weights_close(got, want)
