"""The planner for data parallelism across processes here (issue 36, local accuracy):
``Cluster.local(devices, processes=P)`` / ``from_local(figures, devices, processes=P,
latency_s=)`` -- P nodes sharing the cores, linked by EPL's cross-process all-reduce as
calibrated (cached under keys of their own, measured when first asked for) -- and
``benchmarks/plan_multiprocess.py``'s measurement of plain DP on P worker processes.
No timing is asserted: the figures are faked, or only checked to be positive."""
import json
import os
import sys

import pytest

from epl.auto import Cluster, local
from epl.auto.layout import Layout
from tests import auto_models

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE = {"version": local.CACHE_VERSION, "cores": 2, "matmul_flops": 9e10,
        "matmul_flops_fp16": 9e7, "matmul_flops_bf16": 3e10, "memory_bandwidth": 6e9,
        "op_overhead_s": 1e-6, "run_overhead_s": 2e-4, "allreduce_bandwidth": 2e9,
        "allreduce_latency_s": 1e-4}
# the cross-process links slower than the in-process one (so the terms must differ)
SHM = {"bandwidth": 5e8, "latency_s": 3e-4, "ranks": 2, "beside": {"bandwidth": 1e8}}
TCP = {"bandwidth": 2.5e8, "latency_s": 5e-4, "ranks": 2, "beside": {"bandwidth": None}}
FIGURES = dict(FAKE, xproc_shm=SHM, xproc_tcp=TCP)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A calibration cache of an earlier version of this code: FAKE, without the
    cross-process keys; measuring the in-process figures again is an error."""
    return auto_models.install_calibration(FAKE, tmp_path, monkeypatch)


def test_processes_are_nodes_linked_by_the_cross_process_all_reduce():
    three = Cluster.from_local(dict(FIGURES, cores=4), 1, processes=3)
    assert (three.nodes, three.devices_per_node, three.num_devices) == (3, 1, 3)
    assert three.inter.bandwidth == SHM["bandwidth"] and three.inter.latency == SHM["latency_s"]
    assert three.nic_bandwidth_per_device() == SHM["bandwidth"]
    assert three.intra.bandwidth == FAKE["allreduce_bandwidth"]       # within a process
    one = Cluster.from_local(FIGURES, 1)
    assert three.device.flops("fp32") == pytest.approx(one.device.flops("fp32") / 3)
    assert three.device.memory_bandwidth == pytest.approx(6e9 / 3)
    assert three.device.memory == one.device.memory // 3
    assert three.shared_cores
    # 2 processes x 2 devices: the cores shared 4 ways
    four = Cluster.from_local(FIGURES, 2, processes=2)
    assert (four.nodes, four.devices_per_node) == (2, 2)
    assert four.device.flops("fp32") == pytest.approx(9e10 / 4)
    assert four.nic_bandwidth_per_device() == pytest.approx(SHM["bandwidth"] / 2)
    back = Cluster.from_dict(json.loads(three.to_json()))
    assert back.nodes == 3 and back.inter.bandwidth == SHM["bandwidth"]
    assert back.inter.kind == "epl-shm-crossprocess"


def test_processes_crowding_the_cores_use_figures_measured_with_as_many_ranks():
    # 3 processes on 2 cores: a rank waits on peers the OS has not scheduled
    assert [local.crowded_ranks(p, 2) for p in (1, 2, 3, 5)] == [2, 2, 3, 5]
    assert [local.crowded_ranks(p, 4) for p in (2, 3, 4, 5)] == [2, 2, 2, 5]
    assert local.xproc_key("shm") == "xproc_shm"
    assert local.xproc_key("tcp", 3) == "xproc_tcp_ranks3"
    crowded = dict(SHM, bandwidth=1e8, latency_s=9e-4, ranks=3, beside={"bandwidth": 5e7})
    with pytest.raises(ValueError, match=r"xproc_shm_ranks3.*3 processes.*ranks=3"):
        Cluster.from_local(FIGURES, 1, processes=3)
    three = Cluster.from_local(dict(FIGURES, xproc_shm_ranks3=crowded), 1, processes=3)
    assert (three.inter.bandwidth, three.inter.latency) == (1e8, 9e-4)
    assert three.inter.beside_bandwidth == 5e7
    # on 4 cores the 3 processes each have one: the 2-rank figures
    roomy = Cluster.from_local(dict(FIGURES, cores=4), 1, processes=3)
    assert roomy.inter.bandwidth == SHM["bandwidth"]
    assert Cluster.from_local(FIGURES, 1, processes=2).inter.bandwidth == SHM["bandwidth"]


def test_namespace_hosts_use_the_tcp_figures_and_the_added_latency():
    hosts = Cluster.from_local(FIGURES, 1, processes=2, latency_s=0.005)
    assert hosts.inter.bandwidth == TCP["bandwidth"]
    assert hosts.inter.latency == pytest.approx(
        TCP["latency_s"] + local.LATENCY_TRIPS_PER_RING_STEP * 0.005)
    assert "5 ms" in hosts.name
    shm = Cluster.from_local(FIGURES, 1, processes=2, transport="shm", latency_s=0.001)
    assert shm.inter.bandwidth == SHM["bandwidth"]


def test_figures_without_the_cross_process_keys_say_how_to_get_them():
    with pytest.raises(ValueError, match="xproc_shm.*cross_process"):
        Cluster.from_local(FAKE, 1, processes=2)
    with pytest.raises(ValueError, match="xproc_tcp"):
        Cluster.from_local(FAKE, 1, processes=2, latency_s=0.005)
    assert Cluster.from_local(FAKE, 2).nodes == 1                 # one process: as before


def test_dp_across_processes_prices_the_cross_node_all_reduce():
    from epl.auto import graph_profile
    from epl.auto.collective_cost import link_allreduce_s, ring_allreduce_s
    from epl.auto.predictor import price
    prof = graph_profile.profile(auto_models.model, auto_models.dataset,
                                 auto_models.optimizer)
    lay = Layout(d=3)
    figures = dict(FIGURES, xproc_shm_ranks3=SHM)     # (3 processes crowd the 2 cores)
    procs = price(prof, lay, Cluster.from_local(figures, 1, processes=3))
    inproc = price(prof, lay, Cluster.from_local(figures, 3))
    grads = procs.breakdown["stages"][0]["gradients"]
    assert grads == inproc.breakdown["stages"][0]["gradients"] > 0
    # across 3 nodes of 1 device: a ring over the cross-process link, nothing within;
    # EPL's buckets (one per variable, at most communication.max_splits) alternate
    # over 2 communicators, each chain paying the latency once per bucket
    variables = procs.breakdown["stages"][0]["variables"]
    chained = -(-min(5, variables) // 2)
    assert variables >= 2 and chained >= 1
    want = ring_allreduce_s(grads, 3, SHM["bandwidth"], SHM["latency_s"] * chained)
    assert procs.breakdown["dp_allreduce_s"] == pytest.approx(want)
    assert procs.breakdown["dp_allreduce_s"] > inproc.breakdown["dp_allreduce_s"] > 0
    # (in one process: EPL's rendezvous, one latency per collective)
    rendezvous = Cluster.from_local(figures, 3).intra
    assert rendezvous.algorithm == "rendezvous"
    assert procs.breakdown["dp_allreduce_s"] - inproc.breakdown["dp_allreduce_s"] == \
        pytest.approx(want - link_allreduce_s(grads, 3, rendezvous, chained))
    # the same compute (the cores shared 3 ways either way), a longer step
    assert procs.breakdown["compute_s"] == pytest.approx(inproc.breakdown["compute_s"])
    assert procs.step_time_s > inproc.step_time_s
    assert procs.breakdown["global_batch"] == 3 * prof.rows
    # an added latency between hosts makes it longer still
    hosts = price(prof, Layout(d=2), Cluster.from_local(FIGURES, 1, processes=2,
                                                        latency_s=0.005))
    near = price(prof, Layout(d=2), Cluster.from_local(FIGURES, 1, processes=2,
                                                       transport="tcp"))
    assert hosts.breakdown["dp_allreduce_s"] == pytest.approx(
        near.breakdown["dp_allreduce_s"]
        + 2 * local.LATENCY_TRIPS_PER_RING_STEP * 0.005 * chained)


def test_an_all_reduce_beside_compute_on_shared_cores_is_not_hidden():
    """Worker processes of one host: EPL's transport works on the cores the backward
    pass uses, so the step pays the all-reduce at its bandwidth beside compute
    (``beside``), whatever the backward pass it could hide behind; a transport with no
    such figure (measured hidden), the in-process one and the GPU presets' NICs as
    before."""
    from epl.auto import graph_profile
    from epl.auto.collective_cost import dp_allreduce_s, ring_allreduce_s
    from epl.auto.predictor import price
    prof = graph_profile.profile(auto_models.model, auto_models.dataset,
                                 auto_models.optimizer)
    two = Cluster.from_local(FIGURES, 1, processes=2)
    assert two.inter.beside_bandwidth == SHM["beside"]["bandwidth"]
    got = price(prof, Layout(d=2), two)
    stage = got.breakdown["stages"][0]
    variables, grads = stage["variables"], stage["reduced"]
    chained = -(-min(5, variables) // 2)
    want = ring_allreduce_s(grads, 2, SHM["beside"]["bandwidth"], SHM["latency_s"] * chained)
    assert got.breakdown["dp_exposed_s"] == pytest.approx(want)
    assert got.breakdown["dp_allreduce_s"] == pytest.approx(
        ring_allreduce_s(grads, 2, SHM["bandwidth"], SHM["latency_s"] * chained))
    # without the figure (a cache of an earlier stop) the all-reduce costs what it did
    old = dict(FIGURES, xproc_shm=dict((k, v) for k, v in SHM.items() if k != "beside"))
    before = price(prof, Layout(d=2), Cluster.from_local(old, 1, processes=2))
    assert before.breakdown["dp_exposed_s"] < got.breakdown["dp_exposed_s"]
    assert got.step_time_s - before.step_time_s == pytest.approx(
        got.breakdown["dp_exposed_s"] - before.breakdown["dp_exposed_s"])
    # tcp measured hidden: no figure; in one process and on a preset nothing crosses it
    hosts = Cluster.from_local(FIGURES, 1, processes=2, latency_s=0.005)
    assert hosts.inter.beside_bandwidth is None
    assert dp_allreduce_s(grads, hosts, 1, 2, beside=True) is None
    assert dp_allreduce_s(grads, Cluster.from_local(FIGURES, 2), 1, 2, beside=True) is None
    assert dp_allreduce_s(grads, Cluster.preset("a100-80gb", nodes=2), 1, 16,
                          beside=True) is None
    back = Cluster.from_dict(json.loads(two.to_json()))
    assert back.inter.beside_bandwidth == SHM["beside"]["bandwidth"]
    with pytest.raises(ValueError, match="beside_bandwidth must be > 0"):
        Cluster.from_dict(dict(json.loads(two.to_json()), inter=dict(
            two.inter.to_dict(), beside_bandwidth=0)))


def test_cross_process_figures_are_measured_once_into_an_old_cache(cache, monkeypatch):
    calls = []

    def fake(transport="shm", ranks=2, **_):
        calls.append(transport if ranks == 2 else (transport, ranks))
        return dict(SHM if transport == "shm" else TCP, ranks=ranks)
    monkeypatch.setattr(local, "measure_cross_process", fake)
    assert Cluster.local(2).nodes == 1 and calls == []            # the old cache loads
    two = Cluster.local(1, processes=2)
    assert calls == ["shm"] and two.inter.bandwidth == SHM["bandwidth"]
    saved = json.load(open(cache))
    assert saved["xproc_shm"]["bandwidth"] == SHM["bandwidth"]
    assert saved["matmul_flops"] == FAKE["matmul_flops"]          # the rest kept
    Cluster.local(1, processes=2)
    assert calls == ["shm"]                                       # cached now
    Cluster.local(1, processes=3)          # more processes than the cache's 2 cores
    assert calls == ["shm", ("shm", 3)]
    assert json.load(open(cache))["xproc_shm_ranks3"]["ranks"] == 3
    Cluster.local(1, processes=3)
    Cluster.local(1, processes=2, latency_s=0.005)
    assert calls == ["shm", ("shm", 3), "tcp"]
    # figures of an earlier stop, without the all-reduce beside compute: measured again
    saved = json.load(open(cache))
    del saved["xproc_shm"]["beside"]
    local.save_cache(saved, cache)
    assert Cluster.local(1, processes=2).inter.beside_bandwidth == SHM["beside"]["bandwidth"]
    assert calls == ["shm", ("shm", 3), "tcp", "shm"]
    assert json.load(open(cache))["xproc_shm"]["beside"] == SHM["beside"]


def test_a_tiny_cross_process_calibration_measures_both_transports():
    for transport in local.TRANSPORTS:
        got = local.measure_cross_process(transport, repeats=2, quick=True, timeout=120)
        assert got["bandwidth"] > 0 and got["latency_s"] >= 0, (transport, got)
        assert len(got["seconds"]) == 2 and all(s > 0 for s in got["seconds"].values())
        beside = got["beside"]       # the same all-reduce beside a product chain
        assert beside["allreduce_s"] > 0 and beside["compute_s"] > 0, (transport, beside)
        assert beside["products"] >= 4 and beside["bytes"] == 4 * (1 << 16)
        assert beside["together_s"] == pytest.approx(beside["compute_s"] + beside["added_s"])
        if beside["bandwidth"] is not None:
            assert beside["bandwidth"] == pytest.approx(beside["bytes"] / beside["added_s"])


def test_a_tiny_three_rank_calibration():
    with pytest.raises(ValueError, match=">= 2 ranks"):
        local.measure_cross_process("shm", ranks=1)
    got = local.measure_cross_process("shm", repeats=2, quick=True, timeout=120, ranks=3)
    assert got["ranks"] == 3 and got["bandwidth"] > 0 and got["latency_s"] >= 0, got
    assert got["beside"]["allreduce_s"] > 0 and got["beside"]["compute_s"] > 0


def test_measure_multiprocess_runs_dp_on_two_worker_processes():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_multiprocess
    status, got = plan_multiprocess.measure_multiprocess("mlp", 2, steps=2, timeout=240)
    assert status == "ok", got
    assert got["step_s"] > 0 and got["peak_bytes"] > 0
    assert [w["worker"] for w in got["workers"]] == [0, 1]
    import plan_accuracy
    assert got["rows_per_step"] == sum(w["rows_per_step"] for w in got["workers"]) \
        == 2 * plan_accuracy.ROWS          # each worker pulls the dataset's batch
    # every worker holds the whole model and its Adam slots (the 4 x 1024 MLP)
    params = 512 * 1024 + 3 * 1024 * 1024 + 1024 * 16 + 4 * 1024 + 16
    assert all(w["held_bytes"] >= 3 * 4 * params for w in got["workers"])
    assert got["peak_bytes"] >= max(w["held_bytes"] for w in got["workers"])
