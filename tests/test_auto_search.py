"""epl.auto.accelerate: candidates dry-run in processes of their own, the fastest
feasible one built; load_strategy skips the search; excluded / time_limit /
memory_limit_bytes are honoured.  (Which candidate is fastest is the benchmark's
business: here the choice must follow the figures measured.)"""
import json
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.auto import search
from tests import auto_models, models

pytestmark = pytest.mark.alone   # it times this machine (conftest.py)


def _train(train_op, steps=3):
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(steps):
            sess.run(train_op)
        names = sorted(v.op.name for v in tf.trainable_variables())
        return dict(zip(names, sess.run([models.value_tensor(sess.graph, n) for n in names])))


def test_strategy_round_trips_and_bad_methods_are_named(tmp_path):
    s = [["pipeline", {"num_stages": 2, "num_micro_batch": 4}], "zero"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(s))
    assert search.normalize(str(path)) == search.normalize(json.dumps(s)) == search.normalize(s)
    assert search.config_of(s, 4)[0] == {"cluster.devices_per_worker": 4,
                                       "auto.auto_parallel": True, "pipeline.num_stages": 2,
                                       "pipeline.num_micro_batch": 4, "zero.level": "v1"}
    with pytest.raises(ValueError, match="unknown optimization method 'tensor'"):
        search.normalize(["tensor"])
    with pytest.raises(ValueError, match="has one of"):
        search.normalize(["data_parallel", "pipeline"])


def test_excluded_methods_are_not_tried():
    cands = search.candidates(4, excluded=["pipeline", "amp", "offload"])
    names = set(n for c in cands for n, _ in c)
    assert not names & {"pipeline", "amp", "offload"}
    assert "data_parallel" in names and "zero" in names


def test_load_strategy_builds_without_searching():
    """Semi-automatic: nothing is dry-run; the built program trains like the same
    config written by hand."""
    strategy = ["data_parallel", "zero"]
    start = time.time()
    ok, result, chosen = epl.auto.accelerate(auto_models.model, auto_models.dataset,
                                             auto_models.optimizer, devices=2,
                                             load_strategy=json.dumps(strategy))
    assert ok and result.report == [] and chosen == search.normalize(strategy)
    got = _train(result.train_op)
    assert time.time() - start < 60
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "zero.level": "v1"}))
    features = tf.data.make_one_shot_iterator(auto_models.dataset()).get_next()
    epl.set_default_strategy(epl.replicate(1))
    loss = auto_models.model(features)
    op = auto_models.optimizer().minimize(
        loss, global_step=tf.train.get_or_create_global_step())
    want = _train(op)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_search_picks_the_fastest_feasible_and_honours_limits(tmp_path):
    """One search over three candidates: the choice is the best measured one among
    those under the memory limit; the strategy file reproduces it."""
    path = str(tmp_path / "best.json")
    excluded = ["accumulation", "pipeline", "amp", "offload", "zero"]
    ok, result, chosen = epl.auto.accelerate(
        auto_models.model, auto_models.dataset, auto_models.optimizer, devices=2,
        excluded=excluded, save_strategy_to_file=path, dry_run_steps=2)
    assert ok
    report = result.report
    assert [e["strategy"] for e in report] == search.candidates(2, excluded)
    measured = [e for e in report if e["status"] == "ok"]
    assert len(measured) == len(report) == 2
    best = max(measured, key=lambda e: e["samples_per_s"])
    assert chosen == best["strategy"]
    assert json.load(open(path)) == chosen


@pytest.mark.parametrize("limit, want", [
    (None, [["data_parallel", None]]),
    (1500, [["data_parallel", None], ["gradient_checkpoint", None]]),
    (500, None),
])
def test_memory_limit_makes_candidates_infeasible(monkeypatch, limit, want):
    """With fixed figures (data parallel: fast, 2000 bytes; + GC: slower, 1000
    bytes) the choice follows the limit; nothing under it: status False."""
    figures = {"data_parallel": (100.0, 2000), "gradient_checkpoint": (80.0, 1000)}

    def fake(fns, strategy, devices, steps, timeout):
        speed, peak = figures[strategy[-1][0]]
        return "ok", {"samples_per_s": speed, "peak_bytes": peak, "step_s": 1.0,
                      "rows_per_step": 32}
    monkeypatch.setattr(search, "measure", fake)
    ok, result, chosen = epl.auto.accelerate(
        auto_models.model, auto_models.dataset, auto_models.optimizer, devices=2,
        excluded=["accumulation", "pipeline", "amp", "offload", "zero"],
        memory_limit_bytes=limit)
    assert chosen == want
    assert ok == (want is not None)
    if limit is not None and ok:
        assert result.report[0]["status"].startswith("infeasible")


def test_time_limit_stops_the_search():
    start = time.time()
    ok, result, chosen = epl.auto.accelerate(
        auto_models.model, auto_models.dataset, auto_models.optimizer, devices=2,
        excluded=["accumulation", "amp", "offload", "zero"], time_limit=0.0)
    assert not ok and result is None and chosen is None
    assert time.time() - start < 30


def test_split_candidate_only_for_a_head_that_is_the_largest_layer():
    assert search.split_head(auto_models.model, auto_models.dataset) is None   # a hidden layer
    head = search.split_head(auto_models.big_head_model, auto_models.dataset)
    assert head == 1
    names = [[n for n, _ in c] for c in search.candidates(2, head=head)]
    assert ["split"] in names
    assert ["split"] not in [[n for n, _ in c] for c in search.candidates(2, head=None)]
    assert ["split"] not in [[n for n, _ in c] for c in search.candidates(1, head=head)]
    assert ["split"] not in [[n for n, _ in c]
                             for c in search.candidates(2, excluded=["split"], head=head)]
    with pytest.raises(ValueError, match="not its last one"):
        search.build(auto_models.model, auto_models.dataset, auto_models.optimizer, ["split"], 2)


def _losses(loss, train_op, steps=4):
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        return [sess.run([loss, train_op])[0] for _ in range(steps)]


def test_split_strategy_equals_the_local_model():
    """["split"]: the backbone data parallel on 2 devices, the head split over both; the
    local model on the global batch (2 x 16 rows) gives the same losses."""
    models.reset()
    ok, result, chosen = epl.auto.accelerate(
        auto_models.big_head_model, auto_models.dataset, auto_models.optimizer, devices=2,
        load_strategy=["split"])
    assert ok and chosen == [["split", None]]
    got = _losses(result.loss, result.train_op)
    graph = tf.get_default_graph()
    head = [op for op in graph.get_operations() if op.type == "MatMul"
            and op.name.startswith("logits/") and "gradients" not in op.name]
    assert len(set(op.device for op in head)) == 2, [(op.name, op.device) for op in head]
    models.reset()
    x = auto_models.dataset().unbatch().batch(2 * auto_models.BATCH, drop_remainder=True)
    features = tf.data.make_one_shot_iterator(x).get_next()
    loss = auto_models.big_head_model(features)
    want = _losses(loss, auto_models.optimizer().minimize(loss))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[-1] < want[0]


def test_search_picks_split_when_only_the_split_head_fits():
    """A memory limit between the split head's figure and data parallelism's: the
    search measures, finds plain DP (whole head on one device) infeasible, picks split."""
    ok, result, chosen = epl.auto.accelerate(
        auto_models.big_head_model, auto_models.dataset, auto_models.optimizer, devices=2,
        excluded=["pipeline", "gradient_checkpoint", "zero", "amp", "offload"],
        memory_limit_bytes=int(3.8 * (1 << 20)))
    report = dict((json.dumps(e["strategy"]), e) for e in result.report) if ok else {}
    assert ok, result
    assert [n for n, _ in chosen] == ["split"], report
    assert report[json.dumps([["data_parallel", None]])]["status"].startswith("infeasible")
    got = _losses(result.loss, result.train_op, 2)
    assert np.isfinite(got).all()
