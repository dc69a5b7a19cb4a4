"""The planner's per-product timing on this machine (``epl.auto.product_timing``): each
distinct product of a model (forward and gradient kernels) is rebuilt alone from its
signature, and ``Cluster.local(products=True)`` prices the model from those times."""
import json

import pytest
import tensorflow as tf

from epl.auto import Cluster, graph_profile, local, product_timing
from epl.auto.layout import Layout
from epl.auto.predictor import price
from tests import auto_models

v1 = tf.compat.v1


def _conv_model(features):
    x, y = features
    x = tf.reshape(x, [-1, 3, 4, 1])              # (the corpus rows: 12 features)
    h = v1.layers.conv2d(x, 8, 3, padding="same", activation=tf.nn.relu, name="layer_0")
    logits = v1.layers.dense(tf.reshape(h, [-1, 3 * 4 * 8]), 4, name="logits")
    return v1.losses.sparse_softmax_cross_entropy(labels=y % 4, logits=logits)


def test_every_product_is_rebuilt_alone_with_its_shapes():
    prof = graph_profile.profile(auto_models.model, auto_models.dataset, auto_models.optimizer)
    sigs = set(s for r in [prof.pre, prof.post] + prof.blocks for s in r.products)
    kinds = set(json.loads(s)[0] for s in sigs)
    assert "MatMul" in kinds and len(sigs) >= 3
    for sig in sigs:
        kind, shapes, attrs = json.loads(sig)
        with tf.Graph().as_default():
            op = product_timing._build(sig, __import__("numpy").random.RandomState(0))
            assert op.type == kind and op.outputs[0].shape.as_list() == shapes[-1]
    # forward kernels: one per product; backward: the gradients of its inputs
    counts = [n for r in [prof.pre, prof.post] + prof.blocks for n in r.products.values()]
    assert sum(n[0] for n in counts) >= 2 and sum(n[1] for n in counts) >= sum(
        n[0] for n in counts)


def test_convolution_kernels_are_timed(tmp_path):
    prof = graph_profile.profile(_conv_model, auto_models.dataset, auto_models.optimizer)
    sigs = [s for r in [prof.pre, prof.post] + prof.blocks for s in r.products]
    kinds = set(json.loads(s)[0] for s in sigs)
    assert {"Conv2D", "Conv2DBackpropFilter"} <= kinds
    got = product_timing.timed(sigs, 2, path=str(tmp_path / "p.json"))
    assert all(v["alone"] >= 0 and v["shared"] >= 0 for v in got.values())
    assert json.load(open(str(tmp_path / "p.json"))).keys() == got.keys()   # cached


def test_price_adds_the_timed_kernels(monkeypatch, tmp_path):
    """With fixed timings every kernel costs 1 ms alone and 3 ms shared: one device's
    products take (kernels) ms, two devices' 3 x (kernels) ms; the FLOP model is not
    used for them."""
    monkeypatch.setenv("EPL_CACHE_DIR", str(tmp_path))
    prof = graph_profile.profile(auto_models.model, auto_models.dataset, auto_models.optimizer)
    monkeypatch.setattr(product_timing, "timed", lambda sigs, cores, path=None: dict(
        (s, {"alone": 1e-3, "shared": 3e-3}) for s in sigs))
    figures = dict(local.measure(quick=True), cores=2)
    kernels = sum(a + b for r in [prof.pre, prof.post] + prof.blocks
                  for a, b in r.products.values())
    for devices, per in ((1, 1e-3), (2, 3e-3)):
        cluster = Cluster.from_local(figures, devices)
        flop_model = price(prof, Layout(d=devices), cluster).breakdown["compute_s"]
        cluster.time_products = True
        timed = price(prof, Layout(d=devices), cluster).breakdown["compute_s"]
        untimed = sum(r.untimed_flops for r in [prof.pre, prof.post] + prof.blocks)
        assert untimed == 0
        # compute = products + pointwise + op overhead: only the products changed
        assert timed - kernels * per == pytest.approx(
            flop_model - _flop_products(prof, cluster), rel=1e-6, abs=1e-9)


def _flop_products(prof, cluster):
    dev = cluster.device
    total = 0.0
    for r in [prof.pre, prof.post] + prof.blocks:
        share = sum(f / dev.product_share(d) for d, f in r.flops_by_dim.items()) / \
            sum(r.flops_by_dim.values()) if r.flops_by_dim and dev.thin_products else 1.0
        total += 3 * r.flops * share * prof.rows / dev.flops("fp32")
    return total
