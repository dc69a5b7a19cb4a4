"""Several backward passes through one EPL collective in one step (issue 24, item 5).

Each gradient op of a collective is a collective of its own: the ranks of one
backward pass must meet in one group, and two backward passes (two losses through
one epl.moe_layer, each with its own tf.gradients call; gradient checkpointing's
check builds a second pass) must not share a group ("arrived twice", or one pass's
sum mixed into the other's).

Oracles: the local model (moe_layer outside epl.split, same groups) trained with the
same two gradient calls; for the bare collectives, the gradients the math gives.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.communicators import op_library
from tests import test_split as ts

pytestmark = pytest.mark.skipif(not op_library.available(), reason="EPL's C++ collectives")

STEPS = 3


def _two_losses(v, n=None):
    """Losses and outputs of moe_layer trained with the sum of two tf.gradients calls
    (one per loss), split over n devices or local."""
    experts = 4
    px = tf.placeholder(tf.float32, [ts.T, ts.D])

    # (a trainable input scale: the gradients cross the dispatch exchange too)
    scale = tf.get_variable("scale", initializer=v["scale"])

    def layer():
        return epl.moe_layer(px * scale, experts, ts.H, top_k=2, num_groups=2,
                             gate_initializer=tf.constant_initializer(v["moe/gate"]))
    if n:
        with epl.split(n):
            y, aux = layer()
    else:
        y, aux = layer()
    first = tf.reduce_mean((y - v["target"]) ** 2)
    second = tf.reduce_mean(tf.abs(y)) + 0.01 * aux
    tvars = tf.trainable_variables()
    grads = [a + b if b is not None else a for a, b in zip(tf.gradients(first, tvars),
                                                           tf.gradients(second, tvars))]
    opt = tf.train.GradientDescentOptimizer(0.5)
    with tf.control_dependencies(grads):
        op = opt.apply_gradients(list(zip(grads, tvars)))
    assigns = []
    for var in tf.global_variables():
        full = v[var.op.name.rsplit("/part_", 1)[0]]
        info = var._save_slice_info  # pylint: disable=protected-access
        if info is not None:
            full = full[info.var_offset[0]:info.var_offset[0] + info.var_shape[0]]
        assigns.append(tf.assign(var, full))
    out = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(assigns)
        for _ in range(STEPS):
            l1, l2, o, _ = sess.run([first, second, y, op], {px: v["x"]})
            out.append((l1, l2, o))
    return out


def test_two_losses_through_one_moe_layer_equal_the_local_model():
    v = ts._moe_values(4)
    v["scale"] = np.linspace(0.5, 1.5, ts.D).astype(np.float32)
    with tf.Graph().as_default():
        want = _two_losses(v)
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    got = _two_losses(v, n=2)
    for (a1, a2, ao), (b1, b2, bo) in zip(want, got):
        np.testing.assert_allclose([b1, b2], [a1, a2], rtol=1e-5)
        np.testing.assert_allclose(bo, ao, rtol=1e-5, atol=1e-6)
    groups = [op.get_attr("group") for op in tf.get_default_graph().get_operations()
              if op.type == "EplAllToAll"]
    # 2 exchanges x 2 ranks x (forward + 2 backward passes); each exchange of each pass
    # one group of 2 ranks.
    assert len(groups) == 12 and sorted(set(groups.count(g) for g in groups)) == [2], groups


@pytest.mark.parametrize("kind", ["all_gather", "all_to_all", "all_reduce"])
def test_two_gradient_calls_through_one_collective(kind):
    """d/dx of two losses over the same collective, one tf.gradients call each, fetched
    in one run: each equals the gradient of its own loss."""
    from epl.communicators import native_ops as C
    n = 2
    rng = np.random.RandomState(0)
    xs = [rng.randn(4, 3).astype(np.float32) for _ in range(n)]
    weights = [[rng.randn(1, 3).astype(np.float32) for _ in range(n)] for _ in range(2)]
    with tf.Graph().as_default():
        x = [tf.constant(a) for a in xs]
        ys = []
        for r in range(n):
            with tf.device("/device:CPU:%d" % r):
                if kind == "all_gather":
                    ys.append(C.all_gather(x[r], "g2", r, n, timeout_seconds=20))
                elif kind == "all_to_all":
                    ys.append(C.all_to_all(x[r], "g2", r, n, timeout_seconds=20)[0])
                else:
                    ys.append(C.all_reduce(x[r], "g2", r, n, timeout_seconds=20))
        losses = [tf.add_n([tf.reduce_sum(ys[r] * w[r]) for r in range(n)]) for w in weights]
        grads = [tf.gradients(loss, x) for loss in losses]
        with tf.Session(config=tf.ConfigProto(
                device_count={"CPU": n})) as sess:
            got = sess.run(grads)
    for k, w in enumerate(weights):
        for r in range(n):
            # d loss / d x_r: the rows of x_r that each rank's output holds, times w.
            if kind == "all_gather":
                want = np.tile(w[0] + w[1], [4, 1])
            elif kind == "all_reduce":
                want = np.tile(w[0] + w[1], [4, 1])
            else:   # rank r's rows [2j, 2j+2) go to rank j
                want = np.concatenate([np.tile(w[j], [2, 1]) for j in range(n)])
            np.testing.assert_allclose(got[k][r], want, rtol=1e-5, err_msg="%s %d %d"
                                       % (kind, k, r))
