"""The scale planner (issue 36, docs/plan.md): Cluster presets, FLOPs and parameters
read from the built graph against Megatron-LM's Eq. 2/3, model-state memory against its
closed form, plan's ranking and memory filter, and Table 1 rows within 15%."""
import json

import pytest

from epl.auto import Cluster, plan, predict
from epl.auto import graph_profile
from epl.auto.gpt import GPT, table1
from epl.auto.layout import Layout
from epl.auto.predictor import price
from epl.plan.__main__ import main as plan_main

GiB = 2 ** 30


@pytest.fixture(scope="module")
def small():
    model = GPT(2, 256, 8, seq=128, vocab=1000, batch=2)
    return model, graph_profile.profile(model.model_fn, model.dataset_fn, model.optimizer_fn)


def _node(devices=8):
    return Cluster.preset("a100-80gb", nodes=1) if devices == 8 else None


def test_presets_follow_the_datasheets():
    a = Cluster.preset("a100-80gb", nodes=4)
    assert a.num_devices == 32 and a.devices_per_node == 8
    assert a.device.peak["fp16"] == 312e12 and a.device.peak["tf32"] == 156e12
    assert a.device.peak["fp32"] == 19.5e12 and a.device.memory == 80 * GiB
    assert a.device.memory_bandwidth == 2039e9
    assert a.inter.bandwidth == 25e9 and a.inter.nics_per_node == 8     # 8 x HDR 200 Gb/s
    assert a.intra.bandwidth == 300e9                                    # 600 GB/s NVLink
    assert Cluster.preset("a100-40gb").device.memory_bandwidth == 1555e9
    h = Cluster.preset("h100-80gb")
    assert h.device.peak["bf16"] == 989e12 and h.inter.bandwidth == 50e9  # NDR 400 Gb/s
    v = Cluster.preset("v100-32gb")
    assert v.device.peak["fp16"] == 125e12 and v.device.memory == 32 * GiB
    with pytest.raises(ValueError, match="presets are"):
        Cluster.preset("tpu")


def test_cluster_json_round_trip(tmp_path):
    a = Cluster.preset("h100-80gb", nodes=2)
    path = str(tmp_path / "c.json")
    a.to_json(path)
    b = Cluster.from_json(path)
    assert b.to_dict() == a.to_dict()
    assert Cluster.from_json('{"preset": "v100-32gb", "nodes": 3}').num_devices == 24


@pytest.mark.parametrize("dims", [(2, 256, 8, 128, 1000), (3, 192, 4, 64, 500)])
def test_flops_and_params_match_eq2_eq3(dims):
    layers, h, a, s, V = dims
    model = GPT(layers, h, a, seq=s, vocab=V)
    prof = graph_profile.profile(model.model_fn, model.dataset_fn, model.optimizer_fn)
    assert prof.params() == model.params()
    assert prof.slots_per_param == 2.0                                  # Adam: m and v
    cluster = Cluster.preset("a100-80gb")
    for gc in (False, True):
        strategy = [["data_parallel", {"degree": 1}]] + (["gradient_checkpoint"] if gc else [])
        pred = predict(None, None, None, strategy, cluster, global_batch=16, profile=prof)
        eq3 = model.flops(16, recompute=gc)
        assert abs(pred.breakdown["executed_flops"] / eq3 - 1) < 0.02
        assert pred.breakdown["executed_flops"] == pytest.approx(eq3, rel=1e-9)


def _closed_form(model, t, p, k):
    l, h, s, V = model.layers, model.hidden, model.seq, model.vocab
    n = (l // p) * (12 * h * h / t + 13 * h)
    if k == 0:
        n += (V + s) * h / t
    if k == p - 1:
        n += 2 * h + (V * h / t if p > 1 else 0)
    return n


@pytest.mark.parametrize("t,p,d", [(1, 1, 8), (2, 2, 2), (4, 1, 2)])
def test_model_state_equals_closed_form(small, t, p, d):
    model, prof = small
    cluster = Cluster.preset("a100-80gb")
    for amp, zero in (("float16", None), (None, None), ("float16", "v1")):
        lay = Layout(t=t, p=p, d=d, micro_batch_size=2, dtype=amp or "fp32", zero=zero)
        pred = price(prof, lay, cluster, global_batch=16 * d)
        for st in pred.breakdown["stages"]:
            n = _closed_form(model, t, p, st["stage"])
            weights_grads = 4 * n if amp else 8 * n          # 2+2 (16-bit) or 4+4 (fp32)
            states = (4 * n if amp else 0) + 8 * n           # fp32 master, Adam m and v
            if zero:
                states /= d
            got = st["weights"] + st["gradients"] + st["optimizer_states"]
            assert got == pytest.approx(weights_grads + states, rel=1e-12)


def test_activations_follow_the_schedule(small):
    _, prof = small
    cluster = Cluster.preset("a100-80gb")

    def acts(**kw):
        lay = Layout(t=1, p=2, d=1, num_micro_batch=8, **kw)
        return [s["activations"] for s in price(prof, lay, cluster, 16).breakdown["stages"]]
    gpipe, ofob, gc = acts(schedule="gpipe"), acts(schedule="1f1b"), acts(recompute=True)
    assert gpipe[0] > ofob[0] and ofob[0] > ofob[1] * 1.5   # 1F1B: stage 0 holds p = 2
    assert gc[0] < ofob[0] * 0.6      # GC keeps the block inputs (+ one block recomputed)


def test_plan_ranks_by_throughput_and_drops_what_does_not_fit(small):
    _, prof = small
    cluster = Cluster.preset("a100-80gb")
    report = plan(None, None, None, cluster, 64, profile=prof)
    rates = [c.prediction.samples_per_s for c in report.candidates]
    assert rates == sorted(rates, reverse=True) and report.best is report.candidates[0]
    assert all(c.prediction.peak_memory_bytes <= cluster.device.memory
               for c in report.candidates)
    for c in report.candidates[:20]:           # each strategy prices the same again
        again = predict(None, None, None, c.strategy, cluster, 64, profile=prof)
        assert again.step_time_s == pytest.approx(c.prediction.step_time_s)
    peaks = sorted(c.prediction.peak_memory_bytes for c in report.candidates)
    limit = peaks[len(peaks) // 2]
    tight = plan(None, None, None, cluster, 64, profile=prof, memory_limit_bytes=limit)
    assert tight.infeasible and all(c.prediction.peak_memory_bytes <= limit
                                    for c in tight.candidates)
    assert len(tight.candidates) + len(tight.infeasible) == len(report.candidates) + len(
        report.infeasible)
    data = json.loads(report.to_json(limit=3))
    assert len(data["candidates"]) == 3 and data["candidates"][0]["strategy"] == \
        json.loads(json.dumps(report.best.strategy))


def test_old_strategy_lists_still_parse():
    lay = Layout.from_strategy('[["pipeline", {"num_stages": 2, "num_micro_batch": 4}], '
                               '"gradient_checkpoint", "zero", "amp"]')
    assert (lay.p, lay.num_micro_batch, lay.recompute, lay.zero, lay.dtype) == \
        (2, 4, True, "v1", "fp16")
    new = Layout.from_strategy([["tensor_parallel", {"degree": 8}],
                                ["pipeline", {"num_stages": 4, "micro_batch_size": 2,
                                              "schedule": "gpipe"}],
                                ["amp", {"dtype": "bfloat16"}]])
    assert (new.t, new.p, new.micro_batch_size, new.schedule, new.dtype) == \
        (8, 4, 2, "gpipe", "bf16")
    assert Layout.from_strategy(new.to_strategy()).describe() == new.describe()
    with pytest.raises(ValueError, match="unknown method"):
        Layout.from_strategy(["sharding"])


@pytest.mark.parametrize("row", [0, 4])
def test_table1_rows_within_15_percent(row):
    r = table1()[row]
    model = GPT(1, r["hidden"], r["heads"])
    prof = graph_profile.profile(model.model_fn, model.dataset_fn, model.optimizer_fn)
    prof = prof.repeated(r["layers"])
    cluster = Cluster.preset("a100-80gb", nodes=r["gpus"] // 8)
    best = max((price(prof, Layout(t=r["t"], p=r["p"], d=r["d"], micro_batch_size=mb,
                                   schedule="interleaved" if r["p"] > 1 else "1f1b",
                                   chunks=2, recompute=True, dtype="fp16"),
                      cluster, r["batch"]) for mb in (1, 2, 4, 8)),
               key=lambda pr: (pr.fits, pr.samples_per_s))
    assert best.fits
    assert abs(best.tflops_per_gpu / r["tflops"] - 1) < 0.15
    full = GPT(r["layers"], r["hidden"], r["heads"])
    assert best.breakdown["executed_flops"] == pytest.approx(full.flops(r["batch"]), rel=0.02)


def test_cli_prints_and_writes_json(tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert plan_main(["--gpt", "4,256,8,128,1000", "--nodes", "1", "--global-batch", "32",
                      "--top", "3", "--json", out]) == 0
    text = capsys.readouterr().out
    assert "rank" in text and "best strategy" in text
    assert json.load(open(out))["candidates"]


def test_cli_plans_this_machine(tmp_path, monkeypatch, capsys):
    """``--cluster local``: this machine's virtual devices (``--devices``) in ``--nodes``
    worker processes, from its cached calibration, handed to ``plan`` (which is tested
    on such clusters elsewhere: here it only records them); what applies only to it,
    or not to it, is refused by name."""
    from epl.auto import local
    from epl.plan import __main__ as cli
    from tests import auto_models
    figures = dict(version=local.CACHE_VERSION, cores=3, matmul_flops=9e10,
                   memory_bandwidth=6e9, allreduce_bandwidth=2e9, allreduce_latency_s=1e-4,
                   xproc_shm=dict(bandwidth=5e8, latency_s=3e-4, ranks=2,
                                  beside=dict(bandwidth=1e8)))
    auto_models.install_calibration(figures, tmp_path, monkeypatch)
    planned = []

    class Planned(Exception):
        pass

    def record(model_fn, dataset_fn, optimizer_fn, cluster, global_batch, **kw):
        planned.append((cluster, global_batch, kw.get("split_variants")))
        raise Planned()
    monkeypatch.setattr(cli, "plan", record)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 3)
    gpt = ["--gpt", "2,64,4,32,100", "--global-batch", "16", "--cluster", "local"]
    for extra, devices, nodes, timed in ((["--devices", "2"], 2, 1, True),
                                         (["--no-kernel-timing"], 3, 1, False),
                                         (["--devices", "2", "--nodes", "2"], 2, 2, True)):
        with pytest.raises(Planned):
            plan_main(gpt + extra)
        cluster, batch, variants = planned[-1]
        assert (cluster.devices_per_node, cluster.nodes, cluster.time_products, batch) == \
            (devices, nodes, timed, 16), extra
        assert cluster.device.name == "local-cpu" and cluster.shared_cores
        assert variants == {}
    assert cluster.inter.beside_bandwidth == 1e8     # worker processes: the shm link
    # the model built under its own epl.split(2): plan's split_variants
    with pytest.raises(Planned):
        plan_main(gpt + ["--split-variant", "2=tests.auto_models:big_head_split2_model"])
    assert planned[-1][2] == {2: auto_models.big_head_split2_model}
    preset = ["--gpt", "2,64,4,32,100", "--global-batch", "16"]
    for argv, flag in ((preset + ["--devices", "2"], "--devices"),
                       (gpt + ["--png", str(tmp_path / "x.png")], "--png"),
                       (gpt + ["--devices", "0"], "--devices"),
                       (preset + ["--split-variant", "2=tests.auto_models:model"],
                        "--split-variant"),
                       (gpt + ["--split-variant", "1=tests.auto_models:model"],
                        "--split-variant"),
                       (gpt + ["--split-variant", "2=tests.auto_models"], "--split-variant")):
        with pytest.raises(SystemExit):
            plan_main(argv)
        assert flag in capsys.readouterr().err
    assert len(planned) == 4


def test_each_candidate_says_what_the_program_must_do_that_no_config_key_does(small):
    """``requires``: tensor parallelism is the model's own ``epl.split`` blocks, and a
    micro-batch other than the dataset's batch means batching the dataset anew (each of
    EPL's micro-batches pulls one batch); in the JSON too."""
    model, prof = small
    report = plan(None, None, None, Cluster.preset("a100-80gb"), 64, profile=prof)
    assert {c.layout.t for c in report.candidates} > {1}
    assert len({c.layout.micro_batch_size for c in report.candidates}) > 1
    for c in report.candidates:
        lay = c.prediction.layout
        assert any("epl.split(%d)" % lay.t in r for r in c.requires) == (lay.t > 1)
        assert any("batched by %d rows" % lay.micro_batch_size in r for r in c.requires) \
            == (lay.micro_batch_size != prof.rows)
    assert json.loads(report.to_json())["candidates"][0]["requires"] == \
        report.candidates[0].requires


def test_plans_for_epls_runtime_keep_the_datasets_batch_as_the_micro_batch(small):
    """On a cluster that runs EPL's own runtime (``Cluster.local``) each micro-batch is a
    batch of the dataset (and the kernels are timed at its rows): ``plan`` enumerates
    that micro-batch size alone unless told others; the presets try several."""
    from epl.auto.planner import layouts
    _, prof = small
    local = Cluster.from_local(dict(matmul_flops=1e10, memory_bandwidth=1e10,
                                    allreduce_bandwidth=1e9, allreduce_latency_s=1e-4),
                               2, memory_bytes=1 << 34)
    assert local.stage_cut == "epl" and prof.rows == 2
    got = layouts(prof, local, 8 * prof.rows)
    assert got and set(lay.micro_batch_size for lay in got) == {prof.rows}
    assert set(lay.d for lay in got) == {1, 2}
    wanted = layouts(prof, local, 8 * prof.rows, micro_batch_sizes=(1, 2))
    assert set(lay.micro_batch_size for lay in wanted) == {1, 2}
    preset = layouts(prof, Cluster.preset("a100-80gb"), 64)
    assert len(set(lay.micro_batch_size for lay in preset)) > 1


def test_rank_puts_the_simplest_of_the_tied_first():
    """Predictions closer than ``tie`` are ties: the simplest of them ranks first (the
    fastest of the equally simple), the rest stay fastest first; no tie: by rate."""
    from epl.auto.planner import rank
    items = [("PP 4", 100.0, 4), ("DP 4", 98.5, 1), ("DP 2", 97.5, 1), ("PP 2", 99.0, 2),
             ("TP 2", 90.0, 1)]
    rate, simple = (lambda c: c[1]), (lambda c: c[2])
    names = lambda xs: [c[0] for c in xs]  # noqa: E731
    assert names(rank(items, rate, simple)) == ["PP 4", "PP 2", "DP 4", "DP 2", "TP 2"]
    assert names(rank(items, rate, simple, tie=0.03)) == ["DP 4", "PP 4", "PP 2", "DP 2",
                                                           "TP 2"]
    # a 1 % tie: only PP 2 (1 % behind) is tied with PP 4; DP 4 (1.5 %) is out
    assert names(rank(items, rate, simple, tie=0.01))[0] == "PP 2"
    assert rank([], rate, simple, tie=0.03) == []


def test_cluster_local_ties_close_predictions_and_the_presets_do_not(small):
    """Cluster.local: its replay's error (~5 %) is larger than the gaps between its top
    layouts, so ``plan`` ranks the simplest within ``LOCAL_TIE`` first; the presets
    rank by samples/s alone.  The tie survives the cluster's JSON."""
    from epl.auto import machines
    local = Cluster.from_local(dict(matmul_flops=1e10, memory_bandwidth=1e10,
                                    allreduce_bandwidth=1e9, allreduce_latency_s=1e-4),
                               4, memory_bytes=1 << 34)
    assert local.tie == machines.LOCAL_TIE > 0 and Cluster.preset("a100-80gb").tie == 0
    assert Cluster.from_dict(local.to_dict()).tie == local.tie
    _, prof = small
    report = plan(None, None, None, local, 8, profile=prof)
    rates = [c.prediction.samples_per_s for c in report.candidates]
    top = max(rates)
    tied = [c for c in report.candidates if c.prediction.samples_per_s >= top * (1 - local.tie)]
    assert (report.best.layout.p, report.best.layout.t) == min(
        (c.layout.p, c.layout.t) for c in tied)
    assert rates[1:] == sorted(rates[1:], reverse=True)


def test_epls_inprocess_allreduce_is_one_rendezvous_timed_without_the_calibrations_runs():
    """In one process EPL's all-reduce is one rendezvous (the last rank reduces every
    rank's tensor: csrc/collectives.cc): one latency per collective at any rank count,
    not a ring's 2 (n-1).  The calibration timed it in Session.runs, whose overhead a
    collective inside a step does not pay.  Both survive the cluster's JSON."""
    from epl.auto import machines
    from epl.auto.collective_cost import dp_allreduce_s, link_allreduce_s, ring_allreduce_s
    small, large, run = 1 << 16, 8 << 20, 5e-5
    figures = dict(matmul_flops=1e10, memory_bandwidth=1e10, run_overhead_s=run,
                   allreduce_bandwidth=1e9, allreduce_latency_s=1e-4,
                   allreduce_seconds={str(small): 1.2e-4, str(large): 1.0e-3})
    local = Cluster.from_local(figures, 4, memory_bytes=1 << 34)
    bandwidth = (large - small) / (1.0e-3 - 1.2e-4)
    latency = (1.2e-4 - run - small / bandwidth) / 2
    assert local.intra.algorithm == "rendezvous"
    assert local.intra.bandwidth == pytest.approx(bandwidth)
    assert local.intra.latency == pytest.approx(latency)
    assert Cluster.from_dict(local.to_dict()).intra.algorithm == "rendezvous"
    # at 2 ranks it is what was calibrated: the ring's price; at 4, one latency
    n = 1 << 20
    assert link_allreduce_s(n, 2, local.intra) == pytest.approx(
        ring_allreduce_s(n, 2, bandwidth, latency))
    assert link_allreduce_s(n, 4, local.intra) == pytest.approx(
        5.0 / 3 * n / bandwidth + 2 * latency)
    assert dp_allreduce_s(n, local, 1, 4, chained=3) == pytest.approx(
        5.0 / 3 * n / bandwidth + 6 * latency)
    # the presets' links are rings
    a100 = Cluster.preset("a100-80gb")
    assert a100.intra.algorithm == "ring" and "algorithm" not in a100.to_dict()["intra"]
    assert link_allreduce_s(n, 4, a100.intra) == ring_allreduce_s(
        n, 4, a100.intra.bandwidth, a100.intra.latency)
    with pytest.raises(ValueError, match="algorithm must be one of ring, rendezvous"):
        machines.Link("x", 1e9, 1e-6, algorithm="tree")
