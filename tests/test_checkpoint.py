"""Checkpoints: DP writes the local model's names; restores reach every replica."""
import glob
import json
import os
import threading
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.runtime import integration
from tests import models

N, BATCH, STEPS = 2, 4, 3


def _init(copies="per_device"):
    epl.init(epl.Config({"cluster.devices_per_worker": N, "cluster.variable_copies": copies}))


def _train_dp_and_save(path, copies="per_device"):
    x, y = models.data(STEPS * N * BATCH)
    _init(copies)
    epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "adam", step)
    saver = tf.train.Saver()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        saver.save(sess, path, global_step=step)
        return models.weights(sess)


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_dp_checkpoint_restores_into_local_model(tmp_path, copies):
    path = str(tmp_path / "model.ckpt")
    trained = _train_dp_and_save(path, copies)
    names = [n for n, _ in tf.train.list_variables(str(tmp_path))]
    assert not any("EPL" in n for n in names), names
    assert "dense/kernel" in names and "global_step" in names
    epl.ir.strategies.reset()
    with tf.Graph().as_default():            # the plain local script
        x, y = models.data(8)
        bx, by = models.input_batch(x, y, BATCH)
        _, loss = models.forward(bx, by)
        models.train_op(loss, "adam", tf.train.get_or_create_global_step())
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path)))
            models.assert_weights_close(models.weights(sess), trained, rtol=0, atol=0)
            assert sess.run(tf.train.get_global_step()) == STEPS


def _fresh_dp_model():
    """The same model in a new graph, annotated for DP, not trained."""
    tf.reset_default_graph()
    _init()
    epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(8)
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    models.train_op(loss, "adam", tf.train.get_or_create_global_step())


def test_restore_reaches_every_replica(tmp_path):
    path = str(tmp_path / "model.ckpt")
    trained = _train_dp_and_save(path)
    _fresh_dp_model()
    saver = tf.train.Saver()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        saver.restore(sess, tf.train.latest_checkpoint(str(tmp_path)))
        for c in range(N):
            got = models.weights(sess, "" if c == 0 else "EPL_REPLICA_%d/" % c)
            models.assert_weights_close(got, trained, rtol=0, atol=0)


def test_saver_built_after_first_run_still_mirrors(tmp_path):
    trained = _train_dp_and_save(str(tmp_path / "model.ckpt"))
    _fresh_dp_model()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())      # rewrite happens here
        tf.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path)))
        got = models.weights(sess, "EPL_REPLICA_1/")
        models.assert_weights_close(got, trained, rtol=0, atol=0)


def test_summaries_written_once(tmp_path):
    _init()
    epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(STEPS * N * BATCH)
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    tf.summary.scalar("loss", loss)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "sgd", step)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path),
                                           save_summaries_steps=1) as sess:
        for _ in range(STEPS):
            sess.run(op)
    events = glob.glob(os.path.join(str(tmp_path), "events.out.tfevents.*"))
    assert len(events) == 1
    values = [v.tag for e in tf.train.summary_iterator(events[0])
              for v in e.summary.value if v.tag == "loss"]
    assert len(values) == STEPS


@pytest.mark.parametrize("use_resource", [False, True])
def test_a_training_step_never_runs_the_savers_save_op(tmp_path, monkeypatch, request,
                                                       use_resource):
    """The Saver a MonitoredTrainingSession makes reads ``global_step``; with resource
    variables its SaveV2 reads the step's ReadVariableOp like the learning-rate schedule
    does.  The step's advance must not wait for it: that edge made every training step
    write a shard of the whole model to ./model_temp_<uuid> (the default prefix "model")."""
    monkeypatch.chdir(tmp_path)
    if use_resource:  # (global_step too: the mode of disable_eager_execution alone)
        tf.enable_resource_variables()
        request.addfinalizer(tf.disable_resource_variables)
    x, y = models.data(STEPS * N * BATCH)
    _init()
    epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by, use_resource=use_resource)
    op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    with tf.train.MonitoredTrainingSession() as sess:
        for _ in range(STEPS):
            sess.run(op)
        upstream = set()
        stack = [op]
        while stack:
            o = stack.pop()
            if o in upstream:
                continue
            upstream.add(o)
            stack.extend(t.op for t in o.inputs)
            stack.extend(o.control_inputs)
    saves = sorted(o.name for o in upstream if o.type in ("SaveV2", "Save", "SaveSlices"))
    assert saves == [], "the training step runs the Saver's %s" % saves
    assert os.listdir(str(tmp_path)) == []


def _save_arange(folder):
    """A checkpoint of one variable, ``w = 0..5``, at step 5, written without EPL; the
    path of its index, and that file's bytes."""
    with tf.Graph().as_default():
        w = tf.get_variable("w", initializer=tf.range(6.0))
        with tf.Session() as sess:
            sess.run(w.initializer)
            prefix = tf.train.Saver([w]).save(sess, str(folder / "model.ckpt"), global_step=5)
    with open(prefix + ".index", "rb") as f:
        return prefix, f.read()


def _restore_as_worker(monkeypatch, prefix, workers=2):
    """Restore ``prefix`` into a fresh ``w`` under epl.init as worker 1 of ``workers``."""
    cluster = ["localhost:1", "localhost:2"][:workers]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": cluster},
                                                "task": {"type": "worker",
                                                         "index": workers - 1}}))
    epl.init(epl.Config({}))
    with tf.Graph().as_default():
        w = tf.get_variable("w", [6], initializer=tf.zeros_initializer())
        with tf.Session() as sess:
            tf.train.Saver([w]).restore(sess, prefix)
            return sess.run(w)


def test_a_worker_waits_for_a_checkpoint_another_worker_is_rewriting(tmp_path, monkeypatch):
    """After a restart the chief saves the step it has just restored again, and
    TensorFlow writes the index at its final path: another worker restoring it at that
    moment can read a cut file (DataLossError, seen in a CI run of test_restarts.py).  EPL retries
    the restore until the chief has written the file."""
    prefix, index = _save_arange(tmp_path)
    with open(prefix + ".index", "wb"):
        pass                                   # the chief opened it for writing: 0 bytes
    def finish():
        with open(prefix + ".index", "wb") as f:
            f.write(index)
    writer = threading.Timer(0.5, finish)
    writer.start()
    try:
        np.testing.assert_array_equal(_restore_as_worker(monkeypatch, prefix), np.arange(6.0))
    finally:
        writer.join()


def test_a_checkpoint_that_stays_cut_is_named(tmp_path, monkeypatch):
    prefix, _ = _save_arange(tmp_path)
    with open(prefix + ".index", "wb"):
        pass
    monkeypatch.setattr(integration, "RESTORE_RETRY_S", 0.3)
    with pytest.raises(tf.errors.DataLossError, match="stayed unreadable.*restore an earlier"):
        _restore_as_worker(monkeypatch, prefix)


def test_a_single_worker_does_not_wait_for_a_cut_checkpoint(tmp_path, monkeypatch):
    prefix, _ = _save_arange(tmp_path)
    with open(prefix + ".index", "wb"):
        pass
    start = time.monotonic()
    with pytest.raises(tf.errors.DataLossError):
        _restore_as_worker(monkeypatch, prefix, workers=1)
    assert time.monotonic() - start < integration.RESTORE_RETRY_S / 2


def _save_w(folder, values, step=5, keep=5, sabotage=None, monkeypatch=None):
    """Saves ``w = values`` at ``step`` under epl.init (one worker: its chief) with a
    Saver keeping ``keep``; ``sabotage``: the real save is followed by this (path) and
    an error, as if the chief were killed while TensorFlow wrote the file."""
    epl.init(epl.Config({}))
    if sabotage is not None:
        real = integration.original

        def killed_after_writing(point):
            fn = real(point)
            if point != "saver.save":
                return fn

            def save(saver, sess, save_path, *args, **kwargs):
                out = fn(saver, sess, save_path, *args, **kwargs)
                sabotage(out)
                raise RuntimeError("killed while writing %s" % out)
            return save
        monkeypatch.setattr(integration, "original", killed_after_writing)
    with tf.Graph().as_default():
        w = tf.get_variable("w", initializer=tf.constant(values, tf.float32))
        saver = tf.train.Saver([w], max_to_keep=keep)
        with tf.Session() as sess:
            sess.run(w.initializer)
            return saver, saver.save(sess, str(folder / "model.ckpt"), global_step=step)


def _read_w(prefix):
    with tf.Graph().as_default():
        w = tf.get_variable("w", [6], initializer=tf.zeros_initializer())
        with tf.Session() as sess:
            tf.train.Saver([w]).restore(sess, prefix)
            return sess.run(w)


def _cut_index(prefix):
    with open(prefix + ".index", "wb"):
        pass


def test_a_chief_killed_while_saving_a_step_again_leaves_the_old_checkpoint_whole(
        tmp_path, monkeypatch):
    """After a restart the chief saves the step it has just restored again.  TensorFlow
    writes the index in place, so a chief killed meanwhile left the newest checkpoint
    cut, and the next restart could not restore it.  EPL writes such a checkpoint beside
    the old one and renames it into place: the old checkpoint stays whole."""
    _, prefix = _save_w(tmp_path, np.arange(6.0))
    with pytest.raises(RuntimeError, match="killed while writing"):
        _save_w(tmp_path, np.arange(6.0) * 2, sabotage=_cut_index, monkeypatch=monkeypatch)
    monkeypatch.undo()
    np.testing.assert_array_equal(_read_w(prefix), np.arange(6.0))
    assert tf.train.latest_checkpoint(str(tmp_path)) == prefix
    # the next save of that step clears what the killed one left
    saver, again = _save_w(tmp_path, np.arange(6.0) * 3)
    assert again == prefix
    np.testing.assert_array_equal(_read_w(prefix), np.arange(6.0) * 3)
    assert not [p for p in os.listdir(str(tmp_path)) if integration.RESAVE_TAG in p]


def test_saving_a_step_again_replaces_it_and_keeps_the_savers_bookkeeping(tmp_path):
    """One Saver saves steps 4 and 5, step 5 again with new values while a reader holds
    its index open, then step 6: the reader's file stays whole, the new values are
    restored, and the Saver's list, the ``checkpoint`` file and ``max_to_keep`` are as
    TensorFlow keeps them."""
    epl.init(epl.Config({}))
    path = str(tmp_path / "model.ckpt")
    with tf.Graph().as_default():
        w = tf.get_variable("w", initializer=tf.range(6.0))
        saver = tf.train.Saver([w], max_to_keep=2)
        with tf.Session() as sess:
            sess.run(w.initializer)
            four = saver.save(sess, path, global_step=4)
            five = saver.save(sess, path, global_step=tf.constant(5))
            index_inode = os.stat(five + ".index").st_ino
            sess.run(w.assign(tf.range(6.0) + 10))
            with open(five + ".index", "rb") as reader:     # a worker restoring it
                assert saver.save(sess, path, global_step=np.int64(5)) == five
                assert len(reader.read()) == os.fstat(reader.fileno()).st_size > 0
            assert os.stat(five + ".index").st_ino != index_inode
            assert saver.last_checkpoints == [four, five]
            six = saver.save(sess, path, global_step=6)
    np.testing.assert_array_equal(_read_w(five), np.arange(6.0) + 10)
    assert saver.last_checkpoints == [five, six]
    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == six
    assert list(state.all_model_checkpoint_paths) == [five, six]
    assert not glob.glob(four + ".*")                  # max_to_keep deleted it
    assert os.path.exists(five + ".meta")
    assert not [p for p in os.listdir(str(tmp_path)) if integration.RESAVE_TAG in p]
