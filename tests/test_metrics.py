"""Streaming metrics under data parallelism equal plain TensorFlow over the same rows.

A TF1 metric (``tf.compat.v1.metrics.accuracy`` / ``mean`` / ``auc``, a hand-made
variable in ``METRIC_VARIABLES``, a tf.keras metric's ``update_state`` / ``result``)
keeps its state in local variables and updates it with ``assign_add`` from each batch.
Under EPL every replica (and micro-batch) computes on its own rows; the metric a program
reads must count all of them, as plain TF does with the whole batch in one run.

Oracle: the same model without EPL, one run per step over the rows every replica pulled
in that step (the global batch).  The update op's value after every step and the
value read at the end must both match.
"""
import os
import pickle

import numpy as np
import pytest
import tensorflow as tf_root
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests.test_control_flow_v2 import v2  # noqa: F401  (the fixture)

STEPS, BATCH = 4, 4   # runs, rows each clone pulls per run


def _metric_modules():
    mods = {"compat.v1": tf_root.compat.v1.metrics}
    if hasattr(tf_root, "metrics") and hasattr(tf_root.metrics, "accuracy") and \
            hasattr(tf_root.metrics, "auc") and tf_root.metrics.mean is tf.metrics.mean:
        mods["tf.metrics"] = tf_root.metrics   # (TF 1.15: the v1 functions at top level)
    return mods


MODULES = _metric_modules()


def _metrics(module, labels, logits, loss):
    """{name: (value, update_op)}: the three metrics the issue measured, and a sum."""
    pred = tf.argmax(logits, 1)
    positive = tf.cast(tf.equal(labels, 0), tf.float32)
    score = tf.nn.softmax(logits)[:, 0]
    total = tf.Variable(0.0, trainable=False, name="logit_sum",
                        collections=[tf.GraphKeys.LOCAL_VARIABLES, tf.GraphKeys.METRIC_VARIABLES])
    return {"accuracy": module.accuracy(labels, pred),
            "mean": module.mean(loss),
            "auc": module.auc(positive, score, num_thresholds=50),
            # made by hand: a sum (it would show a count taken twice, which a ratio hides)
            "sum": (total.read_value(), tf.assign_add(total, tf.reduce_sum(logits)))}


def _staged(x, labels):
    """models.forward in two replicate scopes (pipeline stages); the loss and the
    metrics in the last one."""
    w = models.initial_weights()
    with epl.replicate(1, name="stage_0"):
        h = tf.layers.dense(x, models.HIDDEN, activation=tf.nn.tanh,
                            kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
                            bias_initializer=tf.constant_initializer(w["dense/bias"]))
    stage = epl.replicate(1, name="stage_1")
    with stage:
        logits = tf.layers.dense(h, models.CLASSES,
                                 kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
                                 bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
        loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    return logits, loss, stage


def run_metrics(config, clones, module="compat.v1", train=False, stages=1,
                use_resource=False, share=None, outside=False):
    """Per-step values of the update ops and the values read at the end.  ``config``:
    EPL's (None: plain TF with ``clones`` times the batch per run); ``share(x, y)``: the
    rows of this worker (a multi-worker job; ``clones``: the job's); ``outside``: the
    metrics built after the model's replicate scope."""
    x, y = models.data(STEPS * clones * BATCH)
    if share is not None:
        x, y = share(x, y)
    if config is not None:
        epl.init(epl.Config(config))
        if stages == 1 and not outside:
            epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH if config is not None else clones * BATCH)
    with tf.variable_scope("", use_resource=use_resource):
        if stages == 2 and config is not None:
            logits, loss, stage = _staged(bx, by)
            with stage:
                metrics = _metrics(MODULES[module], by, logits, loss)
        elif outside and config is not None:
            with epl.replicate(1):
                logits, loss = models.forward(bx, by)
            metrics = _metrics(MODULES[module], by, logits, loss)
        else:
            logits, loss = models.forward(bx, by)
            metrics = _metrics(MODULES[module], by, logits, loss)
    names = sorted(metrics)
    updates = [metrics[k][1] for k in names]
    if train:
        updates.append(models.train_op(loss, "sgd"))
    with tf.Session() as sess:
        sess.run([tf.global_variables_initializer(), tf.local_variables_initializer()])
        steps = [sess.run(updates)[:len(names)] for _ in range(STEPS)]
        final = sess.run([metrics[k][0] for k in names])
    return dict(zip(names, np.array(steps).T)), dict(zip(names, final))


def assert_metrics_equal(got, want):
    (got_steps, got_final), (want_steps, want_final) = got, want
    for name in sorted(want_final):
        np.testing.assert_allclose(got_steps[name], want_steps[name], rtol=1e-5, atol=1e-6,
                                   err_msg="%s's update op, per step" % name)
        np.testing.assert_allclose(got_final[name], want_final[name], rtol=1e-5, atol=1e-6,
                                   err_msg="%s read at the end" % name)


@pytest.mark.parametrize("use_resource", [False, True])
@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
@pytest.mark.parametrize("module", sorted(MODULES))
def test_data_parallel_metrics_count_every_replica(module, copies, use_resource):
    config = {"cluster.devices_per_worker": 2, "cluster.variable_copies": copies}
    got = run_metrics(config, 2, module, use_resource=use_resource)
    models.reset()
    assert_metrics_equal(got, run_metrics(None, 2, module, use_resource=use_resource))


@pytest.mark.parametrize("use_resource", [False, True])
@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_metrics_built_after_the_model_scope(copies, use_resource):
    """The metrics read the replica's tensors from outside its scope: their additions join
    the replica (a count too, which waits for the batch's values without reading them)."""
    config = {"cluster.devices_per_worker": 2, "cluster.variable_copies": copies}
    got = run_metrics(config, 2, train=True, use_resource=use_resource, outside=True)
    models.reset()
    assert_metrics_equal(got, run_metrics(None, 2, train=True, use_resource=use_resource))


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_metrics_in_control_flow_v2_mode(v2, copies):  # noqa: F811
    """TF 2.x's graph mode without ``disable_v2_behavior`` (resource variables, control
    flow v2); TF 1.15: the same switches."""
    config = {"cluster.devices_per_worker": 2, "cluster.variable_copies": copies,
              "pipeline.num_micro_batch": 2}
    got = run_metrics(config, 4, train=True)
    models.reset()
    assert_metrics_equal(got, run_metrics(None, 4, train=True))


@pytest.mark.parametrize("train", [False, True])
def test_metrics_with_micro_batches(train):
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}
    got = run_metrics(config, 4, train=train)
    models.reset()
    assert_metrics_equal(got, run_metrics(None, 4, train=train))


@pytest.mark.parametrize("train", [False, True])
def test_metrics_in_the_last_stage_of_a_pipeline(train):
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}
    got = run_metrics(config, 2, train=train, stages=2)
    models.reset()
    assert_metrics_equal(got, run_metrics(None, 2, train=train))


def _hand_made(update):
    """A metric variable made by hand (METRIC_VARIABLES / LOCAL_VARIABLES), written by
    ``update(var, logits)``; returns (the variable, its update op)."""
    x, y = models.data(STEPS * 2 * BATCH)
    models.init_data_parallel(2)
    bx, by = models.input_batch(x, y, BATCH)
    logits, _ = models.forward(bx, by)
    var = tf.Variable(0.0, trainable=False, name="score_total",
                      collections=[tf.GraphKeys.LOCAL_VARIABLES, tf.GraphKeys.METRIC_VARIABLES])
    return var, update(var, logits), (x, y)


def test_hand_made_metric_variable_summed_by_assign_add():
    var, op, (x, y) = _hand_made(lambda v, logits: tf.assign_add(v, tf.reduce_sum(logits)))
    with tf.Session() as sess:
        sess.run(tf.local_variables_initializer())
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        got = sess.run(var)
    models.reset()
    with tf.Graph().as_default():
        logits, _ = models.forward(tf.constant(x), tf.constant(y))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            want = sess.run(tf.reduce_sum(logits))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("how", ["assign", "assign_add of its own value"])
def test_hand_made_metric_variable_not_a_sum_is_refused(how):
    """A running maximum cannot be added up across replicas, whether written by assign or
    by an assign_add of a value read from the variable: refused before the first run,
    naming the variable."""
    def update(v, logits):
        if how == "assign":
            return tf.assign(v, tf.maximum(v, tf.reduce_max(logits)))
        return tf.assign_add(v, tf.maximum(v, tf.reduce_max(logits)) - v)
    _hand_made(update)
    with tf.Session() as sess:
        with pytest.raises(NotImplementedError, match="metric variable 'score_total'"):
            sess.run(tf.local_variables_initializer())


KERAS = ("mean", "accuracy", "auc", "sum")


def run_keras_metrics(config, clones, share=None, train=False):
    """tf.keras metrics used by hand: ``update_state`` every run, ``result()`` at the end
    (the values of ``KERAS``); arguments as ``run_metrics``'."""
    x, y = models.data(STEPS * clones * BATCH)
    if share is not None:
        x, y = share(x, y)
    if config is not None:
        epl.init(epl.Config(config))
        epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH if config is not None else clones * BATCH)
    logits, loss = models.forward(bx, by)
    kinds = {"mean": tf.keras.metrics.Mean(),
             "accuracy": tf.keras.metrics.SparseCategoricalAccuracy(),
             "auc": tf.keras.metrics.AUC(num_thresholds=50),
             "sum": tf.keras.metrics.Sum()}
    ups = [kinds["mean"].update_state(loss),
           kinds["accuracy"].update_state(by, logits),
           kinds["auc"].update_state(tf.cast(tf.equal(by, 0), tf.float32),
                                     tf.nn.softmax(logits)[:, 0]),
           kinds["sum"].update_state(tf.reduce_sum(logits))]
    if train:
        ups.append(models.train_op(loss, "sgd"))
    results = [kinds[k].result() for k in KERAS]
    with tf.Session() as sess:
        sess.run([tf.global_variables_initializer(), tf.local_variables_initializer()]
                 + [v.initializer for m in kinds.values() for v in m.variables])
        for _ in range(STEPS):
            sess.run(ups)
        return sess.run(results)


def test_keras_metric_update_state_and_result():
    got = run_keras_metrics({"cluster.devices_per_worker": 2}, 2)
    models.reset()
    np.testing.assert_allclose(got, run_keras_metrics(None, 2), rtol=1e-5, atol=1e-5,
                               err_msg=str(KERAS))


@pytest.mark.estimator
@pytest.mark.parametrize("how", ["evaluate", "train_and_evaluate"])
def test_estimator_evaluate_reports_every_replica(tmp_path, how):
    """Estimator.evaluate (or train_and_evaluate, local) with eval_metric_ops under DP x2
    (its loss is a tf.metrics.mean the Estimator adds)."""
    steps = 3
    x, y = models.data(steps * 2 * BATCH)

    def model_fn(features, labels, mode):
        logits, loss = models.forward(features, labels)
        ops = {"accuracy": tf.metrics.accuracy(labels, tf.argmax(logits, 1)),
               "auc": tf.metrics.auc(tf.cast(tf.equal(labels, 0), tf.float32),
                                     tf.nn.softmax(logits)[:, 0], num_thresholds=50)}
        train = models.train_op(loss, "sgd", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train,
                                          eval_metric_ops=ops)

    def evaluate(batch, model_dir):
        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        est = tf.estimator.Estimator(model_fn, model_dir=model_dir)
        if how == "train_and_evaluate":
            return tf.estimator.train_and_evaluate(
                est, tf.estimator.TrainSpec(input_fn, max_steps=1),
                tf.estimator.EvalSpec(input_fn, steps=steps, throttle_secs=0))[0]
        est.train(input_fn, steps=1)
        return est.evaluate(input_fn, steps=steps)

    want = evaluate(2 * BATCH, str(tmp_path / "plain"))
    models.init_data_parallel(2)
    got = evaluate(BATCH, str(tmp_path / "epl"))
    for key in ("accuracy", "auc", "loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.alone   # (2 worker processes: conftest.py)
def test_two_workers(tmp_path):
    """Between-graph: 2 workers x 2 devices, each feeding its share of every global batch
    and training: every worker reads the whole job's metrics.  (A graph that only
    evaluates keeps each worker's sums: Estimator's evaluate runs on the chief alone,
    ``test_multi_worker.test_train_and_evaluate_on_two_workers``.)"""
    from tests.test_multi_worker import HERE, launch
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_metrics.py"),
                        str(tmp_path)])
    assert code == 0, out[-5000:]
    want = run_metrics(None, 4, train=True)
    models.reset()
    want_keras = run_keras_metrics(None, 4, train=True)
    for w in range(2):
        with open(str(tmp_path / ("metrics_%d.pkl" % w)), "rb") as f:
            got, got_keras = pickle.load(f)
        assert_metrics_equal(got, want)
        np.testing.assert_allclose(got_keras, want_keras, rtol=1e-5, atol=1e-5,
                                   err_msg="worker %d: %s" % (w, KERAS))
