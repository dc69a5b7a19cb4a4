"""Public API details the original EPL's users rely on (issue 10, item 5)."""
import logging

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.core.config import Config
from tests import models


@pytest.mark.parametrize("key, given, want", [
    ("communication.gradients_reduce_method", "MEAN", "mean"),
    ("communication.gradients_reduce_method", "Sum", "sum"),
    ("amp.level", "o1", "O1"),
    ("zero.level", "V1", "v1"),
    ("offload.level", "V0", "v0"),
    ("pipeline.strategy", "preferforward", "PreferForward"),
    ("gradient_checkpoint.type", "AUTO", "auto"),
    ("amp.loss_scale", "DYNAMIC", "dynamic"),
])
def test_config_values_ignore_case(key, given, want):
    assert Config({key: given}, environ={}).get(key) == want


def test_env_values_ignore_case():
    cfg = Config(environ={"EPL_COMMUNICATION_GRADIENTS_REDUCE_METHOD": "MEAN"})
    assert cfg.get("communication.gradients_reduce_method") == "mean"


def test_env_get_before_init_has_no_cluster():
    env = epl.Env.get()
    assert env.cluster is None
    assert env.config.get("pipeline.num_micro_batch") == 1
    assert not epl.Env.initialized()


def test_add_to_collection_takes_a_list_and_get_all_collections():
    n = 2
    x, y = models.data(n * 4)
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, 4)
    logits, loss = models.forward(bx, by)
    epl.add_to_collection([loss, tf.reduce_sum(logits)], epl.GraphKeys.LOCAL_SUM_OBJECTS)
    epl.add_to_collection(logits, epl.GraphKeys.LOCAL_CONCAT_OBJECTS)
    assert len(epl.GraphKeys.ALL_COLLECTION_KEYS) == 6
    everything = epl.get_all_collections()
    assert sorted(everything) == sorted(epl.GraphKeys.ALL_COLLECTION_KEYS)
    assert everything[epl.GraphKeys.LOCAL_SUM_OBJECTS][0] is loss
    assert len(everything[epl.GraphKeys.LOCAL_SUM_OBJECTS]) == 2
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        total, rows = sess.run([loss, logits])
    assert rows.shape[0] == n * 4          # every replica's rows
    with tf.Graph().as_default():          # the oracle: each replica's loss on its batch
        bx, by = models.input_batch(x, y, 4)
        _, one = models.forward(bx, by)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            want = sess.run(one) + sess.run(one)
    np.testing.assert_allclose(total, want, rtol=1e-5)


def test_add_to_collection_rejects_non_tensors():
    with pytest.raises(TypeError, match="tf.Tensor or a list"):
        epl.add_to_collection([1.0], epl.GraphKeys.LOCAL_SUM_OBJECTS)


@pytest.mark.estimator
def test_run_config_distribution_strategy_is_ignored_with_a_warning(tmp_path, caplog):
    """An Estimator script that asks for MirroredStrategy runs under EPL's data
    parallelism instead (and equals the local model at the doubled batch)."""
    n, steps, batch = 2, 3, 4
    x, y = models.data(steps * n * batch)

    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        op = models.train_op(loss, "momentum", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    epl.set_default_strategy(epl.replicate(1))
    with caplog.at_level(logging.WARNING, logger="epl"):
        config = tf.estimator.RunConfig(
            train_distribute=tf.distribute.MirroredStrategy(["/cpu:0"]))
    assert config.train_distribute is None
    assert "train_distribute" in caplog.text and "ignored" in caplog.text
    est = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path / "est"), config=config)
    est.train(lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), steps=steps)
    got = {k: est.get_variable_value(k) for k in models.initial_weights()}
    from epl.core.process_state import Env
    Env._instance = None  # pylint: disable=protected-access
    want, _ = models.train_local(x, y, n * batch, steps, "momentum")
    models.assert_weights_close(got, want)
