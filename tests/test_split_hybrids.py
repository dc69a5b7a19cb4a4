"""Transformer split blocks composed with the other parallelisms (issue 35, part 3).

The GPT-style decoder of tests/transformer_models.py with its blocks under ``split(2)``:

* next to data parallelism: embeddings and LM head under ``replicate(1)`` (2 replicas),
  the blocks under ``split(2)``, on 4 devices (with and without ZeRO over the 2
  replicas, with gradient checkpointing), and on 2 workers x 2 devices (the blocks
  on the second worker);
* with gradient checkpointing inside the split blocks (the blocks' forward ops are
  recomputed shard by shard, on their shards' devices);
* with AMP O1 inside the split blocks (the shards' products in float16), alone and in
  the hybrid above.

Oracle: the same model code built without EPL (same initial values, same batches):
losses before each of 4 Adam updates and every weight and Adam slot after them (read
through a checkpoint), rel. 1e-5 (absolute 1e-5 for weights near zero).  A replicated
loss fetched is replica 0's (its half of the batch): the oracle's loss of those rows.
AMP is compared with the mixed-precision program of the same products: the local
model whose dense layers compute the same per-shard products (the row-parallel sums of
float16 partial products are rounded per shard, not once), under ``amp.level`` O1 on
one device (weights to absolute 3e-5, see the test).

Data-parallel split groups (every scope split(2) on 4 devices: 2 groups of 2; and 2
workers, a group each) and pipelines of split blocks (2 split(2) stages, 4 micro-batches,
both schedules; 2 such pipelines on 8 devices) equal the local model on the global
batch; pipelines mixing split and replicate stages are refused by name.
"""
import contextlib
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.features import gradient_checkpoint
from epl.tf_adapter import version
from epl.rewrite.updates import VARIABLE_OPS
from tests import models
from tests import transformer_models as tm
from tests.test_split_attention import traced_products

STEPS, BATCH = 4, 4


def _adam(loss):
    # epsilon 1e-4: see tests/test_split_attention.py (weights with ~0 gradients).
    return tf.train.AdamOptimizer(0.01, epsilon=1e-4).minimize(
        loss, global_step=tf.train.get_or_create_global_step())


def _train(model, tmpdir, name, loss_rows=None, checkpoints=False, loss_from=0):
    """(losses before each step, weights after the last, the graph).  ``loss_rows``
    (the oracle of a replicated loss): the loss fetched is that of the batch's first
    ``loss_rows`` rows (EPL splits a fed batch among the replicas in order: replica 0
    computes the first rows), or of those from row ``loss_from``."""
    ids, labels = tm.data(BATCH * STEPS)
    pi = tf.placeholder(tf.int64, [None, tm.SEQ])
    pl = tf.placeholder(tf.int64, [None, tm.SEQ])
    if checkpoints:
        block = model.block

        def checkpointed(x, i):
            y = block(x, i)
            tf.add_to_collection(gradient_checkpoint.COLLECTION, y)
            return y
        model.block = checkpointed
    loss = model.build(pi, pl)
    op = _adam(loss)
    losses = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(STEPS):
            rows = slice(i * BATCH, (i + 1) * BATCH)
            feed = {pi: ids[rows], pl: labels[rows]}
            if loss_rows:
                part = slice(i * BATCH + loss_from, i * BATCH + loss_from + loss_rows)
                losses.append(sess.run(loss, {pi: ids[part], pl: labels[part]}))
                sess.run(op, feed)
            else:
                losses.append(sess.run([loss, op], feed)[0])
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    weights = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    return np.array(losses), weights, tf.get_default_graph()


def _local(tmpdir, make=tm.Decoder, **kw):
    with tf.Graph().as_default():
        return _train(make(), tmpdir, "local", **kw)


def _assert_same(got, want, atol=1e-5, loss_rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=loss_rtol, err_msg="losses")
    assert sorted(got[1]) == sorted(want[1])
    for k in sorted(want[1]):
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=atol, err_msg=k)


def _devices(graph, prefix, types):
    return set(o.device for o in graph.get_operations()
               if (o.name.startswith(prefix) or "/" + prefix in o.name) and o.type in types)


# -- 2 replicas x split(2) -------------------------------------------------------------

def _replicated_ends(i):
    """Embeddings (i = -1) and the LM head with the loss (i = LAYERS) replicated, the
    blocks split."""
    return epl.replicate(1) if i in (-1, tm.LAYERS) else epl.split(2)


@pytest.mark.parametrize("extra", ["", "zero", "gc"])
def test_two_replicas_and_split_blocks_match_local(extra, tmpdir):
    """4 devices: the replicated embeddings and head on devices 0 and 1 (2 replicas,
    each its half of the batch), the blocks split over devices 2 and 3 (the whole
    batch): the local model on the global batch.  ``zero``: zero.level v1, the
    replicated variables' Adam slots partitioned over the 2 replicas; ``gc``:
    gradient_checkpoint.type auto (replicas and shards recompute)."""
    want = _local(tmpdir, loss_rows=BATCH // 2)
    zero = extra == "zero"
    epl.init(epl.Config(dict({"cluster.devices_per_worker": 4},
                             **{"": {}, "zero": {"zero.level": "v1"},
                                "gc": {"gradient_checkpoint.type": "auto"}}[extra])))
    got = _train(tm.Decoder(scope=_replicated_ends), tmpdir, "hybrid")
    _assert_same(got[:2], want[:2])
    g = got[2]
    assert len(_devices(g, "lm_head/", ["MatMul"])) == 2
    heads = _devices(g, "block_0/", ["BatchMatMulV2", "BatchMatMul"])
    assert len(heads) == 2 and not heads & _devices(g, "lm_head/", ["MatMul"])
    if extra == "gc":
        recomputed = set(o.device for o in g.get_operations() if o.name.endswith("_recompute"))
        assert len(recomputed) == 4, recomputed
    if zero:   # each replicated variable's slots on one replica's device, both used
        slots = {}
        for o in g.get_operations():
            if o.type in VARIABLE_OPS and "/Adam" in o.name and not o.name.startswith("block_"):
                slots.setdefault(o.name.split("/Adam")[0], set()).add(o.device)
        assert sorted(slots) == ["lm_head/bias", "lm_head/kernel", "ln_f/beta", "ln_f/gamma",
                                 "pos_emb", "tok_emb"], slots
        assert all(len(d) == 1 for d in slots.values()), slots
        assert set.union(*slots.values()) == _devices(g, "lm_head/", ["MatMul"]), slots


# -- data-parallel split groups: 2 groups x split(2) ------------------------------------

@pytest.mark.parametrize("extra", ["", "per_device", "zero", "gc"])
def test_split_groups_match_local(extra, tmpdir):
    """Every scope ``split(2)`` on 4 devices: 2 groups (data parallel), each its half of
    the batch, each split over its own 2 devices; the gradients of shard j's variables
    averaged between the devices holding shard j.  The local model on the global batch
    (the loss fetched: group 0's rows).  ``per_device``: every device its own copy of
    the variables (as on GPUs); ``zero``: zero.level v1 (each variable and its Adam
    slots on one group's device of its shard); ``gc``: gradient_checkpoint.type auto."""
    want = _local(tmpdir, loss_rows=BATCH // 2)
    config = {"": {}, "per_device": {"cluster.variable_copies": "per_device"},
              "zero": {"zero.level": "v1"},
              "gc": {"gradient_checkpoint.type": "auto"}}[extra]
    epl.init(epl.Config(dict({"cluster.devices_per_worker": 4}, **config)))
    got = _train(tm.Decoder(scope=lambda i: epl.split(2)), tmpdir, "groups")
    _assert_same(got[:2], want[:2])
    g = got[2]
    placed = {}
    for o in g.get_operations():
        if "block_0/" in o.name and o.type in ("BatchMatMulV2", "BatchMatMul") \
                and "gradients" not in o.name:
            placed.setdefault(o.name.startswith("EPL_"), set()).add(o.device[-5:])
    # group 0 (the user's ops) on CPU:0/1, group 1 (the copies) on CPU:2/3
    assert placed == {False: {"CPU:0", "CPU:1"}, True: {"CPU:2", "CPU:3"}}, placed
    if extra == "zero":   # shard j's variables (and slots) on the devices of shard j
        owners = set()
        for o in g.get_operations():
            if o.type in VARIABLE_OPS and o.name.startswith("block_"):
                part = o.name.split("/part_")[1].split("/")[0] if "/part_" in o.name else None
                if part is not None:   # part_j: device j of a group (CPU:j or CPU:j+2)
                    assert int(o.device[-1]) % 2 == int(part), (o.name, o.device)
                    owners.add(o.device[-5:])
        assert owners == {"CPU:0", "CPU:1", "CPU:2", "CPU:3"}, owners   # both groups own some
    if extra == "gc":
        recomputed = set(o.device for o in g.get_operations() if o.name.endswith("_recompute"))
        assert len(recomputed) == 4, recomputed


def test_split_groups_run_their_products_on_their_devices(tmpdir):
    """A traced step of 2 groups x split(2): the attention products of block 0 ran on all
    4 devices."""
    epl.init(epl.Config({"cluster.devices_per_worker": 4}))
    ids, labels = tm.data(BATCH)
    pi = tf.placeholder(tf.int64, [None, tm.SEQ])
    pl = tf.placeholder(tf.int64, [None, tm.SEQ])
    op = _adam(tm.Decoder(scope=lambda i: epl.split(2)).build(pi, pl))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        ran = traced_products(sess, op, {pi: ids, pl: labels})
    assert sorted(ran) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"], ran


def test_split_groups_need_a_divisible_device_count():
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))
    model = tm.Decoder(scope=lambda i: epl.split(2))
    with pytest.raises(ValueError, match=r"3 devices cannot be divided into split groups of 2"):
        _train(model, "unused", "refused")


# -- gradient checkpointing inside split blocks -----------------------------------------

@pytest.mark.parametrize("kind", ["collection", "auto"])
def test_gradient_checkpoint_inside_split_blocks_matches_local(kind, tmpdir):
    want = _local(tmpdir)
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "gradient_checkpoint.type": kind}))
    got = _train(tm.Decoder(scope=lambda i: epl.split(2)), tmpdir, "gc",
                 checkpoints=kind == "collection")
    _assert_same(got[:2], want[:2])
    ir = epl.Graph.get(got[2])
    recomputed = [o for o in got[2].get_operations() if o.name.endswith("_recompute")
                  and ir.phase_of(o) == "backward" and o.type.startswith("BatchMatMul")]
    # The attention products are recomputed on both shards' devices.
    assert len(set(o.device for o in recomputed)) == 2, [o.name for o in recomputed]


# -- AMP inside split blocks ------------------------------------------------------------

_ROW_PARALLEL = ("proj", "fc_out")   # read the sharded output of a column-parallel layer


class _PerShardProducts(tm.Decoder):
    """The decoder whose dense layers compute split(n)'s products: column-parallel
    layers one product per column shard (each casting its input), row-parallel layers
    the sum of one product per row shard; same variables, same values.  Outside the
    blocks one product per replica's rows (``replicas``)."""

    n, replicas = 2, 1

    def dense(self, x, units, name, activation=None, use_bias=True):
        scope = tf.get_variable_scope().name
        full = "%s/%s" % (scope, name) if scope else name
        k = int(x.shape[-1])
        # (the initial values drawn in tf.layers.dense's order: kernel, then bias)
        kinit = tm._init(self.values, full + "/kernel", [k, units], self.rng)  # pylint: disable=protected-access
        binit = tm._init(self.values, full + "/bias", [units], self.rng)  # pylint: disable=protected-access
        with tf.variable_scope(name):
            kernel = tf.get_variable("kernel", [k, units], initializer=kinit)
            bias = tf.get_variable("bias", [units], initializer=binit) if use_bias else None
        flat = tf.reshape(x, [-1, k])
        if not scope.startswith("block_"):
            # (replicas: one product per replica's rows)
            y = tf.concat([tf.matmul(f, kernel) for f in tf.split(flat, self.replicas)], 0)
        elif name in _ROW_PARALLEL:
            rows = np.array_split(np.arange(k), self.n)
            y = tf.add_n([tf.matmul(flat[:, r[0]:r[-1] + 1], kernel[r[0]:r[-1] + 1])
                          for r in rows])
        else:
            cols = np.array_split(np.arange(units), self.n)
            y = tf.concat([tf.matmul(flat, kernel[:, c[0]:c[-1] + 1]) for c in cols], -1)
        if bias is not None:
            y = y + bias
        y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [units]], 0))
        return activation(y) if activation else y


def _split_blocks(i):
    return epl.split(2) if 0 <= i < tm.LAYERS else contextlib.nullcontext()


@pytest.mark.parametrize("hybrid", [False, True])
def test_amp_inside_split_blocks_matches_the_mixed_precision_program(hybrid, tmpdir):
    """``hybrid``: the embeddings and head replicated over 2 devices (each replica's
    products over its rows), the blocks split over the other 2."""
    amp = {"amp.level": "O1", "amp.loss_scale": 128}
    with tf.Graph().as_default():
        epl.init(epl.Config(dict(amp, **{"cluster.devices_per_worker": 1})))
        oracle = _PerShardProducts()
        oracle.replicas = 2 if hybrid else 1
        want = _train(oracle, tmpdir, "local", loss_rows=BATCH // 2 if hybrid else None)
    models.reset()
    epl.init(epl.Config(dict(amp, **{"cluster.devices_per_worker": 4 if hybrid else 2})))
    got = _train(tm.Decoder(scope=_replicated_ends if hybrid else _split_blocks), tmpdir,
                 "amp")
    # atol 3e-5: a float32 sum in another order (the gradient of a block's input, from
    # its shards) may round to another float16 in the next product; after 4 Adam steps
    # that moves a weight near 0 by ~1e-5 (TF 2.21).  Losses: rel. 1e-5.  oneDNN's
    # float16 products on CPUs with native float16 arithmetic (AVX512-FP16: an Intel
    # Xeon with AMX) round inside the product, so the sharded and whole products differ
    # more: measured 7.4e-5 on a weight, 9.7e-5 rel. on a loss after 4 steps; a missing
    # shard or a wrong loss scale moves them by 1e-2 and more.
    native = version.onednn_enabled()
    _assert_same(got[:2], want[:2], atol=2e-4 if native else 3e-5,
                 loss_rtol=3e-4 if native else 1e-5)
    assert [o for o in want[2].get_operations() if o.type == "MatMul"
            and o.get_attr("T") == tf.float16]   # (the oracle is mixed precision too)
    half = [o for o in got[2].get_operations() if o.name.startswith("block_0/")
            and o.type in ("BatchMatMulV2", "BatchMatMul", "MatMul")
            and o.get_attr("T") == tf.float16 and "gradients" not in o.name]
    # Every product of the blocks' forward pass in float16, on both devices.
    assert len(set(o.device for o in half)) == 2
    assert not [o.name for o in got[2].get_operations() if o.name.startswith("block_0/")
                and "gradients" not in o.name and o.type == "BatchMatMulV2"
                and o.get_attr("T") == tf.float32 and "_fp16" not in o.name
                and any(c.type != "Shape" for c in o.outputs[0].consumers())]


# -- pipelines of split blocks -----------------------------------------------------------

def _two_split_stages():
    stages = [epl.split(2, name="stage_0"), epl.split(2, name="stage_1")]
    # embeddings and block 0 on stage 0, block 1 and the head on stage 1
    return lambda i: stages[0] if i < 1 else stages[1]


@pytest.mark.parametrize("schedule,devices,micro", [("PreferForward", 4, 4),
                                                    ("PreferBackward", 4, 4),
                                                    ("PreferBackward", 8, 2)])
def test_pipeline_of_split_blocks_matches_local(schedule, devices, micro, tmpdir):
    """Two split(2) scopes as 2 pipeline stages, ``micro`` micro-batches: stage s shard j
    on device 2s + j (8 devices: 2 such pipelines, data parallel).  The local model on the
    global batch (gradient accumulation over the micro-batches); the loss fetched is
    micro-batch 0's (its rows)."""
    want = _local(tmpdir, loss_rows=BATCH // (micro * devices // 4))
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro, "pipeline.strategy": schedule}))
    got = _train(tm.Decoder(scope=_two_split_stages()), tmpdir, "pipe")
    _assert_same(got[:2], want[:2])
    g = got[2]
    user = lambda prefix: set(o.device[-5:] for o in g.get_operations()  # noqa: E731
                              if o.name.startswith(prefix) and "gradients" not in o.name
                              and o.type in ("BatchMatMulV2", "BatchMatMul"))
    assert user("block_0/") == {"CPU:0", "CPU:1"} and user("block_1/") == {"CPU:2", "CPU:3"}
    products = set(o.device[-5:] for o in g.get_operations() if o.type.startswith("BatchMatMul"))
    assert len(products) == devices, products
    ends = [o for o in g.get_operations() if o.name.startswith("EPL_SCHEDULE/")]
    assert len(ends) == 2 * 2 * micro * (devices // 4)   # F and B of every stage, micro-batch


def test_gradient_accumulation_of_a_split_model_matches_local(tmpdir):
    """One split(2) scope around the whole model, 2 micro-batches on 2 devices: the
    micro-batches' gradients accumulated, one update (the local model on the batch)."""
    want = _local(tmpdir, loss_rows=BATCH // 2)
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}))
    whole = epl.split(2)
    got = _train(tm.Decoder(scope=lambda i: whole), tmpdir, "accumulate")
    _assert_same(got[:2], want[:2])


def test_pipeline_of_split_and_replicate_scopes_is_refused_by_name():
    """Stages under replicate next to split stages, with micro-batches: not built; the
    refusal names both scopes and the setting."""
    epl.init(epl.Config({"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 4}))
    model = tm.Decoder(scope=lambda i: epl.replicate(1) if i < 0 else epl.split(2))
    with pytest.raises(NotImplementedError, match=r"num_micro_batch = 4: pipelines of split "
                                                  r"and replicate scopes together"):
        _train(model, "unused", "refused")


# -- 2 workers: replicated ends on one, split blocks on the other ------------------------

@pytest.mark.alone   # (2 worker processes: conftest.py)
def test_two_workers_replicas_and_split_blocks_match_local(tmp_path):
    """2 workers x 2 devices (epl-launch), in-graph: the replicated embeddings and head
    on worker 0's devices, the blocks split over worker 1's; the local model on the
    global batch.  (Each worker splitting over its own devices: the split groups'
    test below.)"""
    from tests.test_multi_worker import HERE, launch
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "2",
                        os.path.join(HERE, "mw_split_hybrid.py"), str(tmp_path)],
                       cwd=str(tmp_path))
    assert code == 0 and "chief finished hybrid" in out, out[-5000:]
    got = dict(np.load(str(tmp_path / "hybrid.npz")))
    heads, head = [str(d) for d in got.pop("heads")], [str(d) for d in got.pop("head")]
    assert len(heads) == 2 and all("task:1" in d for d in heads), heads
    assert len(head) == 2 and all("task:0" in d for d in head), head
    want = _local(tmp_path, loss_rows=BATCH // 2)
    _assert_same((got.pop("losses"), {k[2:]: v for k, v in got.items()}), want[:2])


@pytest.mark.alone   # (2 worker processes: conftest.py)
def test_two_workers_each_a_split_group_match_local(tmp_path):
    """2 workers x 2 devices (epl-launch), between-graph: each worker one split(2) group
    over its own devices, feeding its half of every global batch; the local model on the
    global batch (each worker's losses: those of its rows)."""
    from tests.test_multi_worker import HERE, launch
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "2",
                        os.path.join(HERE, "mw_split_groups.py"), str(tmp_path)],
                       cwd=str(tmp_path))
    assert code == 0 and "worker 1 finished split groups" in out, out[-5000:]
    half = BATCH // 2
    reader = tf.train.load_checkpoint(str(tmp_path / "groups"))
    weights = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    for w in (0, 1):
        res = np.load(str(tmp_path / ("worker_%d.npz" % w)))
        want = _local(tmp_path, loss_rows=half, loss_from=w * half)
        _assert_same((res["losses"], weights), want[:2])
        heads = [str(d) for d in res["heads"]]
        assert len(heads) == 2, heads   # its attention products on its own 2 devices
