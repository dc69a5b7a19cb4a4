"""What tf.keras reports under data parallelism is the global batch's, as without EPL.

Keras feeds each step's batch into the model's Inputs: EPL splits it over the replicas
(and micro-batches).  The loss, the stateful metrics (accuracy: a total and a count; AUC:
confusion counts per threshold), ``evaluate``'s numbers, the logs callbacks read and
``predict``'s rows must then be those of the whole batch, not of replica 0's share.
Oracle: the same CTR-like model (embeddings of integer features, a Dense tower)
without EPL on the same global batch.
"""
import os
import pickle

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models

FIELDS, VOCAB, DIM, HIDDEN = 3, 20, 4, 8
ROWS, BATCH, EPOCHS = 48, 16, 3


class _BatchLogs(tf.keras.callbacks.Callback):
    """Records the logs every batch hands to callbacks (what EarlyStopping & co. read)."""

    def __init__(self):
        super(_BatchLogs, self).__init__()
        self.batches = []

    def on_batch_end(self, batch, logs=None):
        self.batches.append({k: v for k, v in (logs or {}).items() if k not in ("batch", "size")})


def _data(rows=ROWS, seed=0):
    rng = np.random.RandomState(seed)
    x = [rng.randint(0, VOCAB, (rows, 1)).astype(np.int32) for _ in range(FIELDS)]
    y = (rng.rand(rows, 1) < 0.4).astype(np.float32)
    return x, y


def _model():
    rng = np.random.RandomState(1)

    def const(*shape):
        return tf.constant_initializer((rng.randn(*shape) * 0.5).astype(np.float32))

    inputs = [tf.keras.Input((1,), dtype=tf.int32, name="f%d" % i) for i in range(FIELDS)]
    embedded = [tf.keras.layers.Flatten()(
        tf.keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=const(VOCAB, DIM))(t))
        for t in inputs]
    h = tf.keras.layers.Concatenate()(embedded)
    h = tf.keras.layers.Dense(HIDDEN, activation="relu", kernel_initializer=const(FIELDS * DIM,
                                                                               HIDDEN))(h)
    out = tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer=const(HIDDEN, 1))(h)
    model = tf.keras.Model(inputs, out)
    model.compile(tf.keras.optimizers.SGD(0.5), "binary_crossentropy",
                  metrics=["accuracy", tf.keras.metrics.AUC(name="auc", num_thresholds=50)])
    return model


def train(batch=BATCH, share=lambda arrays: arrays, set_weights=False, predict=True):
    """fit (History with validation, per-batch logs), evaluate and predict on the rows
    ``share`` picks from every global batch (a worker's); returns what keras reported."""
    model = _model()
    x, y = _data()
    vx, vy = _data(32, seed=2)
    x, y, vx, vy = share(x), share(y), share(vx), share(vy)
    if set_weights:   # (backend.batch_set_value: a placeholder of unknown shape per weight)
        model.set_weights([w * 1.5 for w in model.get_weights()])
    logs = _BatchLogs()
    history = model.fit(x, y, batch_size=batch, epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=[logs], validation_data=(vx, vy))
    out = {"history": history.history, "batches": logs.batches, "weights": model.get_weights(),
           "evaluated": model.evaluate(vx, vy, batch_size=batch, verbose=0)}
    if predict:
        out["predicted"] = model.predict(x, batch_size=batch)
    tf.keras.backend.clear_session()
    return out


def _run(config, **kwargs):
    models.reset()
    tf.keras.backend.clear_session()
    if config is not None:
        epl.init(epl.Config(config))
        epl.set_default_strategy(epl.replicate(1))
    return train(**kwargs)


def assert_reports_equal(got, want, rows=slice(None)):
    """``got`` (EPL) reports what ``want`` (the local model on the global batch) does;
    ``rows``: the rows of want's predictions got predicted."""
    for a, b in zip(got["weights"], want["weights"]):   # (EPL trains right: the premise)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert sorted(got["history"]) == sorted(want["history"]) == [
        "acc", "auc", "loss", "val_acc", "val_auc", "val_loss"]
    for key in want["history"]:
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=1e-5,
                                   atol=1e-6, err_msg="History[%r]" % key)
    assert len(got["batches"]) == len(want["batches"]) == EPOCHS * ROWS // BATCH
    for i, (a, b) in enumerate(zip(got["batches"], want["batches"])):
        assert sorted(a) == sorted(b)
        for key in b:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6,
                                       err_msg="batch %d logs[%r]" % (i, key))
    np.testing.assert_allclose(got["evaluated"], want["evaluated"], rtol=1e-5, atol=1e-6,
                               err_msg="evaluate: [loss, acc, auc]")
    if "predicted" not in got:
        return
    want_rows = want["predicted"][rows]
    assert got["predicted"].shape == want_rows.shape, "predict"
    np.testing.assert_allclose(got["predicted"], want_rows, rtol=1e-5, atol=1e-6,
                               err_msg="predict")


CONFIGS = {
    "dp2": {"cluster.devices_per_worker": 2},
    "dp2_ga2": {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_keras_reports_the_global_batch(name):
    """Every epoch starts by resetting the metrics: the epochs after the first (and
    evaluate, and each validation) match only if every replica's copy was reset."""
    assert_reports_equal(_run(CONFIGS[name], predict="ga" not in name), _run(None))


def test_predict_with_micro_batches_is_refused():
    """Each micro-batch's forward pass, loss included, runs after the previous one's
    (the pipeline schedule); predict feeds no targets: refused with the reason."""
    models.reset()
    tf.keras.backend.clear_session()
    epl.init(epl.Config(CONFIGS["dp2_ga2"]))
    epl.set_default_strategy(epl.replicate(1))
    model = _model()
    with pytest.raises(NotImplementedError, match="predict.*'pipeline.num_micro_batch' = 2"):
        model.predict(_data()[0], batch_size=BATCH)
    tf.keras.backend.clear_session()


def test_set_weights():
    """``set_weights`` assigns each weight through a placeholder of unknown dimensions:
    a value for the variable, not a batch to split over the replicas."""
    assert_reports_equal(_run(CONFIGS["dp2"], set_weights=True), _run(None, set_weights=True))


def worker_share(worker, workers, batch=BATCH):
    """The rows of ``worker`` in every global batch of ``batch`` rows."""
    per = batch // workers

    def share(arrays):
        if isinstance(arrays, list):
            return [share(a) for a in arrays]
        idx = np.concatenate([np.arange(s + worker * per, s + (worker + 1) * per)
                              for s in range(0, len(arrays), batch)])
        return arrays[idx]
    return share


@pytest.mark.alone   # (2 worker processes: conftest.py)
def test_two_workers(tmp_path):
    """Two workers, each feeding its half of every global batch: both report the global
    batch's loss and metrics (combined across workers), and predict their own rows."""
    from tests.test_multi_worker import HERE, launch
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_keras.py"),
                        str(tmp_path)])
    assert code == 0, out[-5000:]
    want = _run(None)
    for w in range(2):
        with open(str(tmp_path / ("keras_%d.pkl" % w)), "rb") as f:
            got = pickle.load(f)
        idx = worker_share(w, 2)(np.arange(ROWS))
        assert_reports_equal(got, want, rows=idx)
