"""A tensor-parallel layout on this machine is priced on the step EPL builds of the
model's own ``epl.split(t)`` variant (``predict``'s ``split_variants``), replayed like a
pipeline's built step (issue 36).  Priced by region (the split kernels timed as shards
and summed) the MLP's and the GPT's TP 2 read -9 and -12 % on TF 2.x, TP 2 x DP 2 -13
and -12 %; on the built step -4, -6, +2 and 0 % (stop 71).  No timing is asserted here:
the structure of the step, and that the price stands on it."""
import types

import pytest

from epl.auto import Cluster, graph_profile, local_step, predictor
from epl.auto.layout import Layout
from tests import auto_models
from tests.test_planner_local import FAKE
from tests.test_split_head_step import _shapes

LOCAL = types.SimpleNamespace(time_products=True, nodes=1, stage_cut="epl")


@pytest.fixture(scope="module")
def profile():
    prof = graph_profile.profile(auto_models.big_head_model, auto_models.dataset,
                                 auto_models.optimizer)
    prof.split_variants = {2: auto_models.big_head_split2_model}
    return prof


def _copy(profile, **changes):
    prof = profile.__class__.__new__(profile.__class__)
    prof.__dict__.update(profile.__dict__)
    prof.__dict__.update(changes)
    return prof


@pytest.mark.parametrize("d", [1, 2])
def test_a_split_layout_is_epls_built_step_of_the_split_variant(profile, d):
    """TP 2 (x DP 2): each of the t x d devices runs its shard of the head (the head's
    inner dimension halved, row-parallel) on its replica's rows: the whole step, every
    device in it; no device runs the whole head.  The variant is built as its user runs
    it: without the default ``replicate`` the whole model's built steps get (beside a
    split over every device EPL refuses it: the variant was priced by region)."""
    lay = Layout(t=2, d=d, micro_batch_size=profile.rows)
    flow, whole = local_step.flow_of(profile, lay, LOCAL, True)
    assert whole
    devices = sorted(set(flow["devices"]) - {""})
    assert len(devices) == 2 * d, devices
    classes = auto_models.HEAD_CLASSES
    for device in devices:
        shards = [s for s, dev in zip(flow["sigs"], flow["devices"]) if dev == device and s
                  and [profile.rows, 32] in _shapes(s) and [32, classes] in _shapes(s)]
        assert shards, "no head shard (32 of 64 inner) on %s" % device
    assert not [s for s in flow["sigs"] if s and [64, classes] in _shapes(s)]


@pytest.mark.parametrize("change", [dict(recompute=True), dict(zero="v1"),
                                    dict(offload=True), dict(dtype="bf16"), dict(t=4)])
def test_a_split_layout_the_built_step_does_not_stand_for_is_priced_by_region(profile,
                                                                             change):
    """GC, ZeRO, offload and AMP of a split layout, and a degree with no variant, are
    priced by region, as before, and nothing is built."""
    built = []
    prof = _copy(profile, built_dataflow=lambda config, model=None: built.append(config))
    lay = Layout(**dict(dict(t=2, d=2 if "zero" in change else 1,
                             micro_batch_size=profile.rows), **change))
    assert local_step.flow_of(prof, lay, LOCAL, True) == (None, False)
    assert not built


def test_a_split_variant_that_cannot_be_built_is_priced_by_region(profile, caplog):
    def unbuildable(config, model=None):
        raise RuntimeError("epl.auto: building the model with %r failed: PicklingError"
                           % (config,))
    prof = _copy(profile, built_dataflow=unbuildable)
    with caplog.at_level("WARNING", logger="epl"):
        got = local_step.flow_of(prof, Layout(t=2, d=1, micro_batch_size=profile.rows),
                                 LOCAL, True)
    assert got == (None, False)
    assert "priced by region" in caplog.text and "PicklingError" in caplog.text


def test_a_split_layouts_price_stands_on_its_built_step(profile, tmp_path, monkeypatch):
    """``predict`` with ``split_variants`` on the local cluster with timed kernels
    replays the split variant's built step (both devices in it, one copy) and stands
    the step on that replay.  Its memory stays the whole model's step walked as its
    split (that built step walked read the MLP's TP 2 13.5 % under its TF 1.15 run).
    Without the variant: priced by region."""
    auto_models.install_calibration(FAKE, tmp_path, monkeypatch)
    replays = []

    def replay(flow, timings, costs, input_seconds, cores, flops, copies, processes=1,
               wake="wait", bandwidth=None):
        replays.append((sorted(set(flow.get("devices") or [""]) - {""}), copies))
        return 0.25
    monkeypatch.setattr(local_step, "timed", lambda sigs, cores, op, step=None: (
        dict((s, dict(alone=1e-5, shared=2e-5, first=1e-5)) for s in sigs),
        dict(op=1e-6, handoff=0.0, hop=0.0, cold=None, mix=0.0)))
    monkeypatch.setattr(local_step, "replay", replay)
    strategy = [["tensor_parallel", {"degree": 2}]]
    cluster = Cluster.local(2, products=True)
    got = predictor.predict(None, None, None, strategy, cluster,
                            profile=_copy(profile, split_variants={}),
                            split_variants={2: auto_models.big_head_split2_model})
    assert replays and all(len(devices) == 2 and copies == 1 for devices, copies in replays)
    assert got.breakdown["pipeline_s"] == pytest.approx(0.25)
    del replays[:]
    plain = predictor.predict(None, None, None, strategy, cluster,
                              profile=_copy(profile, split_variants={}))
    assert not replays and plain.breakdown["pipeline_s"] != pytest.approx(0.25)
    assert got.memory_bytes == plain.memory_bytes and got.breakdown["stages"][0]["liveness"]
