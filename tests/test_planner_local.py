"""The planner on this machine (issue 36, local half): ``Cluster.local`` from a cached
calibration (shared cores: per-device figures / N), the calibration run itself (tiny),
the strategy entries the planner added as ``accelerate`` reads them, and ``accelerate``
dry-running only the planner's first candidates.  No timing is asserted: the
calibration is faked or tiny, dry runs are monkeypatched."""
import json

import pytest

from epl.auto import Cluster, local, search
from epl.auto.layout import Layout
from tests import auto_models

FAKE = {"version": local.CACHE_VERSION, "cores": 2, "matmul_flops": 8e10,
        "matmul_flops_fp16": 8e7, "matmul_flops_bf16": 4e10, "memory_bandwidth": 1e10,
        "op_overhead_s": 1e-6, "run_overhead_s": 2e-4, "allreduce_bandwidth": 2e9,
        "allreduce_latency_s": 1e-4}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A calibration cache holding FAKE; measuring again is an error unless asked."""
    return auto_models.install_calibration(FAKE, tmp_path, monkeypatch)


def test_local_cluster_shares_the_cores_between_virtual_devices(cache):
    one, four = Cluster.local(1), Cluster.local(4)
    assert one.num_devices == 1 and four.num_devices == 4 and four.nodes == 1
    assert one.device.flops("fp32") == pytest.approx(8e10)
    assert four.device.flops("fp32") == pytest.approx(2e10)        # total / N
    assert four.device.flops("fp16") == pytest.approx(2e7)         # CPU float16: slow
    assert four.device.memory_bandwidth == pytest.approx(2.5e9)
    assert four.device.memory == one.device.memory // 4
    assert four.intra.bandwidth == 2e9 and four.intra.latency == 1e-4
    assert four.device.run_overhead == 2e-4 and four.device.op_overhead == 1e-6
    back = Cluster.from_dict(json.loads(four.to_json()))
    assert back.device.run_overhead == 2e-4
    assert not back.accumulate_in_place and not back.fusion_buffer      # EPL here, measured
    assert Cluster.preset("a100-80gb").accumulate_in_place                # Megatron's


def test_epl_keeps_one_gradient_copy_per_micro_batch_here(cache):
    """EPL's pipeline sums the micro-batches' gradients at the end (measured by
    benchmarks/plan_accuracy.py): m copies on the local cluster, one in place."""
    from epl.auto import graph_profile
    from epl.auto.predictor import price
    prof = graph_profile.profile(auto_models.model, auto_models.dataset,
                                 auto_models.optimizer)
    cluster = Cluster.local(2)
    lay = Layout(p=2, d=1, num_micro_batch=4)
    here = price(prof, lay, cluster)
    cluster.accumulate_in_place = True
    in_place = price(prof, lay, cluster)
    for a, b in zip(here.breakdown["stages"], in_place.breakdown["stages"]):
        assert a["gradient_copies"] == 4 and b["gradient_copies"] == 1
    assert here.memory_bytes[0] - in_place.memory_bytes[0] == pytest.approx(
        3 * here.breakdown["stages"][0]["gradients"], abs=2)


def test_recalibration_is_forced_by_argument_or_environment(cache, monkeypatch):
    calls = []

    def fake(**_):
        calls.append(1)
        return dict(FAKE, matmul_flops=1e11)
    monkeypatch.setattr(local, "measure", fake)
    assert Cluster.local(1).device.flops("fp32") == pytest.approx(8e10)     # cached
    assert Cluster.local(1, recalibrate=True).device.flops("fp32") == pytest.approx(1e11)
    assert json.load(open(cache))["matmul_flops"] == 1e11                  # re-cached
    monkeypatch.setenv("EPL_RECALIBRATE", "1")
    Cluster.local(2)
    assert len(calls) == 2


def test_a_tiny_calibration_run_measures_every_figure(tmp_path):
    got = local.calibration(path=str(tmp_path / "c.json"), quick=True)
    for key in ("matmul_flops", "matmul_flops_fp16", "matmul_flops_bf16",
                "memory_bandwidth", "allreduce_bandwidth"):
        assert got[key] > 0, key
    assert got["op_overhead_s"] >= 0 and got["run_overhead_s"] > 0
    assert json.load(open(str(tmp_path / "c.json")))["cores"] == got["cores"]
    from epl.auto import cold_reads
    assert got["cache_bytes"] == cold_reads.cache_bytes()      # the kind of machine


def test_the_local_replay_pays_wake_ups_by_the_machines_last_level_cache(monkeypatch):
    """Cluster.local's ``wake_up``: "work" on a machine with a large last-level cache (the
    Xeon with 480-504 MiB), "wait" on one with a small one (32-33 MiB) or none shown;
    from the calibration's ``cache_bytes``, else (a cache written before it was
    recorded) this machine's."""
    from epl.auto import cold_reads, machines
    figures = dict(matmul_flops=1e10, memory_bandwidth=1e10, allreduce_bandwidth=1e9,
                   allreduce_latency_s=1e-4)
    for nbytes, rule in ((504 << 20, "work"), (480 << 20, "work"), (32 << 20, "wait"),
                         (None, "wait")):
        assert Cluster.from_local(dict(figures, cache_bytes=nbytes), 2).wake_up == rule
    monkeypatch.setattr(cold_reads, "cache_bytes", lambda: 480 << 20)
    assert Cluster.from_local(figures, 2).wake_up == "work"
    monkeypatch.setattr(cold_reads, "cache_bytes", lambda: 33 << 20)
    assert Cluster.from_local(figures, 2).wake_up == "wait"
    assert machines.wake_up_for(machines.LARGE_CACHE_BYTES) == "work"
    assert Cluster.preset("a100-80gb").wake_up == "wait"       # (not replayed)


def test_overheads_are_priced_on_the_local_cluster(cache):
    from epl.auto import graph_profile
    from epl.auto.predictor import price
    prof = graph_profile.profile(auto_models.model, auto_models.dataset,
                                 auto_models.optimizer)
    assert sum(r.ops for r in prof.blocks) > 0
    cluster = Cluster.local(2)
    lay = Layout(d=2)
    with_overhead = price(prof, lay, cluster).step_time_s
    cluster.device.run_overhead = cluster.device.op_overhead = 0.0
    assert with_overhead > price(prof, lay, cluster).step_time_s + 2e-4 - 1e-12


def test_planner_entries_are_read_where_epl_runs_them():
    assert search.normalize([["tensor_parallel", {"degree": 1}], "data_parallel"]) == \
        [["data_parallel", None]]
    with pytest.raises(ValueError, match="tensor_parallel.*epl.split"):
        search.normalize([["tensor_parallel", {"degree": 2}], "data_parallel"])
    with pytest.raises(ValueError, match="interleaved"):
        search.normalize([["pipeline", {"num_stages": 2, "schedule": "interleaved"}]])
    with pytest.raises(ValueError, match="v1"):
        search.normalize(["data_parallel", ["zero", {"level": "v2"}]])
    cfg, _ = search.config_of([["pipeline", {"num_stages": 2, "num_micro_batch": 4,
                                             "schedule": "gpipe"}]], 2)
    assert cfg["pipeline.strategy"] == "PreferForward"
    cfg, _ = search.config_of([["pipeline", {"num_stages": 2, "micro_batch_size": 4}]], 2,
                              rows=16)
    assert cfg["pipeline.num_micro_batch"] == 4 and "pipeline.strategy" not in cfg
    with pytest.raises(ValueError, match="degree 4 on 2 devices"):
        search.config_of([["data_parallel", {"degree": 4}]], 2)
    # what plan's candidates carry runs through accelerate's parser
    lay = Layout(p=2, d=1, num_micro_batch=4, schedule="gpipe", recompute=True,
                 dtype="bfloat16")
    cfg, default = search.config_of(lay.to_strategy(), 2)
    assert not default and cfg["pipeline.num_stages"] == 2
    assert cfg["pipeline.strategy"] == "PreferForward" and cfg["amp.dtype"] == "bfloat16"
    assert cfg["gradient_checkpoint.type"] == "auto"
    assert search.layout_of(lay.to_strategy(), 2).describe() == Layout(
        p=2, d=1, num_micro_batch=4, schedule="gpipe", recompute=True,
        dtype="bfloat16").describe()


# Fixed figures per candidate (by its last method): what a dry run would measure.
SPEED = {"data_parallel": 100.0, "accumulation": 90.0, "pipeline": 40.0,
         "gradient_checkpoint": 70.0, "zero": 95.0, "amp": 5.0, "offload": 50.0}


def _search(monkeypatch, **kw):
    calls = []

    def fake(fns, strategy, devices, steps, timeout):
        calls.append(strategy)
        return "ok", {"samples_per_s": SPEED[strategy[-1][0]], "peak_bytes": 1000,
                      "step_s": 1.0, "rows_per_step": 32}
    monkeypatch.setattr(search, "measure", fake)
    ok, result, chosen = search.accelerate(auto_models.model, auto_models.dataset,
                                           auto_models.optimizer, devices=2, **kw)
    assert ok
    return calls, result, chosen


def test_accelerate_dry_runs_only_the_planners_first_candidates(cache, monkeypatch):
    every, _, want = _search(monkeypatch, dry_run_top=None)
    assert len(every) == len(search.candidates(2)) == 7
    # (the planner's first three here: accumulation, the 2-stage pipeline (its idle
    # fill and drain lend their cores to the busy stage), data parallelism)
    calls, result, chosen = _search(monkeypatch, dry_run_top=3)
    assert chosen == want == [["data_parallel", None]]
    assert len(calls) == 3 < len(every)
    skipped = [e for e in result.report if e["status"] == "skipped (predicted slower)"]
    assert len(skipped) == 4 and all("predicted_samples_per_s" in e for e in skipped)
    # the planner's order: nothing skipped is predicted faster than what was run
    ran = [e for e in result.report if e["status"] == "ok"]
    assert min(e["predicted_samples_per_s"] for e in ran) >= \
        max(e["predicted_samples_per_s"] for e in skipped)
    amp = [e for e in result.report if e["strategy"][-1][0] == "amp"][0]
    assert amp["status"].startswith("skipped")      # float16 products are slow on CPU


def test_unpriced_candidates_are_always_dry_run(cache, monkeypatch):
    SPEED["split"] = 10.0
    try:
        calls, _, chosen = _search(monkeypatch, dry_run_top=1, excluded=["split"])
        assert len(calls) == 1 and chosen == calls[0]       # the planner's first
        args = (auto_models.big_head_model, auto_models.dataset, auto_models.optimizer,
                search.candidates(2, head=1), 2)
        split = [c for c in search.rank(*args) if c[0] == [["split", {"layer": 1}]]]
        assert split[0][1] is not None and split[0][1].layout.split_head   # priced now
        real = search.layout_of

        def unpriced_split(strategy, devices):
            if any(not isinstance(i, str) and i[0] == "split" for i in strategy):
                raise ValueError("epl.auto: not priced")
            return real(strategy, devices)
        monkeypatch.setattr(search, "layout_of", unpriced_split)
        cands = search.rank(*args)
        assert cands[0][0] == [["split", {"layer": 1}]] and cands[0][1] is None
    finally:
        SPEED.pop("split")


def test_layout_of_reads_the_models_own_tensor_parallelism():
    """``["tensor_parallel", {"degree": t}]`` (the model's epl.split(t) scopes, which EPL
    runs as devices / t groups) is t x d for the planner; accelerate still refuses to
    build it (it does not split a model)."""
    tp = [["tensor_parallel", {"degree": 2}]]
    for devices, d in ((2, 1), (4, 2)):
        lay = search.layout_of(tp, devices)
        assert (lay.t, lay.p, lay.d) == (2, 1, d)
    lay = search.layout_of(tp + [["pipeline", {"num_stages": 2, "num_micro_batch": 4}]], 8)
    assert (lay.t, lay.p, lay.d, lay.num_micro_batch) == (2, 2, 2, 4)
    lay = search.layout_of(["data_parallel", "offload"], 2)
    assert (lay.t, lay.d, lay.offload) == (1, 2, True)
    assert search.layout_of(["data_parallel"], 4).t == 1
    with pytest.raises(ValueError, match="degree 2 on 3 devices"):
        search.layout_of(tp, 3)
    assert search.layout_of(["split"], 2).split_head
    with pytest.raises(ValueError, match="epl.split"):
        search.normalize(tp)


@pytest.mark.parametrize("split", [None, 2])
def test_gpt_split_builds_every_part_under_its_own_split_scope(split):
    """GPT(split=t): the embeddings, each block and the head (with the loss) are split
    task graphs of t devices, their weights sharded; without it, none is."""
    import tensorflow.compat.v1 as tf
    import epl
    from epl import ir
    from epl.auto.gpt import GPT
    with pytest.raises(ValueError, match="split 0"):
        GPT(1, 12, 3, split=0)
    epl.init(epl.Config({"cluster.devices_per_worker": 4}))
    gpt = GPT(2, 16, 4, seq=8, vocab=32, batch=2, split=split)
    loss = gpt.model_fn(tf.data.make_one_shot_iterator(gpt.dataset_fn()).get_next())
    groups = [tg for tg in ir.Graph.get().taskgraphs if tg.kind == "split"]
    names = [v.op.name for v in tf.global_variables()]
    if split is None:
        assert not groups and not [n for n in names if "/part_" in n]
        return
    assert len(groups) == 4 and all(tg.device_count == 2 for tg in groups)
    assert loss.op in groups[-1].ops
    for i, part in enumerate(groups[1:3]):       # the blocks, in order
        assert any(op.name.startswith("gpt/layer_%d/" % i) for op in part.ops)
    for layer in ("q", "k", "v", "proj", "fc1", "fc2"):     # (Q, K, V: heads EPL splits)
        assert "gpt/layer_1/%s/kernel/part_1" % layer in names
    assert not [n for n in names if "/qkv/" in n]


def test_the_split_head_is_priced(cache):
    """The replicated-backbone / split-head hybrid (accelerate's "split"): the head's
    matrices are held 1/d per device and left out of the gradient all-reduce; its
    input is gathered from every replica.  Its strategy round-trips."""
    from epl.auto import graph_profile
    from epl.auto.predictor import price
    prof = graph_profile.profile(auto_models.big_head_model, auto_models.dataset,
                                 auto_models.optimizer)
    head = prof.post.params_split
    assert head >= 64 * auto_models.HEAD_CLASSES
    cluster = Cluster.local(2)
    dp = price(prof, Layout(d=2), cluster)
    split = price(prof, search.layout_of(["split"], 2), cluster)
    s_dp, s_split = dp.breakdown["stages"][0], split.breakdown["stages"][0]
    assert s_dp["params"] - s_split["params"] == pytest.approx(head / 2.0)
    assert s_split["reduced"] == pytest.approx(s_split["gradients"] - head / 2.0 * 4)
    assert s_dp["reduced"] == s_dp["gradients"]
    assert split.breakdown["tp_comm_s"] > 0 == dp.breakdown["tp_comm_s"]
    # (plain SGD: half the head's weights and gradients fewer per device)
    assert dp.peak_memory_bytes - split.peak_memory_bytes == pytest.approx(head / 2.0 * 8)
    lay = search.layout_of(["split"], 2)
    assert lay.split_head and lay.to_strategy() == ["split"]
    assert search.layout_of(lay.to_strategy(), 2).describe() == lay.describe()
    with pytest.raises(ValueError, match="split head"):
        price(prof, Layout(d=1, p=2, num_micro_batch=2, split_head=True), Cluster.local(2))
