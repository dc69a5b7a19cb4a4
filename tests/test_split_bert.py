"""The test corpus' whole mini-BERT (tests/corpus/bert.py: embeddings, encoder layers,
pooler, classifier, its own AdamWeightDecay written with assign ops, global-norm
clipping and global_step + 1 by hand) under one ``epl.split`` scope, unchanged
(issue 35): its attention stays head-parallel and it trains like the local model.

* split(2) on 2 devices, and split(4) with 4 heads (``bert.HEADS`` patched: the corpus
  model has 2) on 4 devices;
* split(2) on 4 devices: 2 data-parallel groups, each its half of the batch.

Oracle: the same program without EPL, same initial values and batches: losses of 5
steps and every weight and optimizer moment after them (read through a checkpoint),
rel. 1e-5 (absolute 1e-5 near zero).  A fetched loss in the groups case is group 0's:
the oracle's loss of those rows."""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests.corpus import bert
from tests.test_split_attention import _assert_same

STEPS, BATCH = 5, 4


def _train(tmpdir, name, n=None, loss_rows=None):
    data = bert.data(BATCH * STEPS, seed=3)
    shapes = [[None, bert.SEQ]] * 3 + [[None]]
    places = [tf.placeholder(tf.as_dtype(a.dtype), s) for a, s in zip(data, shapes)]
    if n is None:
        loss = bert.model(places)
    else:
        with epl.split(n):
            loss = bert.model(places)
    op = bert.train_op(loss, num_steps=STEPS, careful=True)
    losses = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(STEPS):
            rows = slice(i * BATCH, (i + 1) * BATCH)
            if loss_rows:
                part = slice(i * BATCH, i * BATCH + loss_rows)
                losses.append(sess.run(loss, dict(zip(places, [a[part] for a in data]))))
                sess.run(op, dict(zip(places, [a[rows] for a in data])))
            else:
                losses.append(sess.run([loss, op], dict(zip(places, [a[rows] for a in data])))[0])
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    weights = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    return np.array(losses), weights, tf.get_default_graph()


def _attention_devices(graph):
    """Devices of the attention products' shards (forward)."""
    return set(o.device for o in graph.get_operations()
               if "/layer_" in o.name and "/shard_" in o.name and "gradients" not in o.name
               and o.type in ("BatchMatMulV2", "BatchMatMul"))


@pytest.mark.parametrize("n,heads,devices", [(2, 2, 2), (4, 4, 4), (2, 2, 4)])
def test_corpus_bert_under_split_matches_local(n, heads, devices, tmpdir, monkeypatch):
    monkeypatch.setattr(bert, "HEADS", heads)
    groups = devices // n
    loss_rows = BATCH // groups if groups > 1 else None
    with tf.Graph().as_default():
        want = _train(tmpdir, "local", loss_rows=loss_rows)
    epl.init(epl.Config({"cluster.devices_per_worker": devices}))
    got = _train(tmpdir, "split", n)
    _assert_same(got[:2], want[:2])
    # the attention products of every layer on every device (each group its own)
    assert len(_attention_devices(got[2])) == devices, _attention_devices(got[2])
