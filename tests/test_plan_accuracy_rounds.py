"""benchmarks/plan_accuracy.py prices a row with each heavy kernel's fastest round, as it
keeps a row's fastest measured round, and with each light kernel's mean over the rounds
(``fastest_kernels``)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import plan_accuracy  # noqa: E402
from epl.auto import product_timing  # noqa: E402


def _round(monkeypatch, folder, timings):
    """A round whose kernels were timed into ``folder`` (round 1's case: no pricing)."""
    monkeypatch.setenv("EPL_CACHE_DIR", str(folder))
    path = product_timing.cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(timings, f)


def test_each_heavy_kernel_keeps_its_least_figures_over_the_rounds(monkeypatch, tmp_path):
    best, rounds = {}, {}
    _round(monkeypatch, tmp_path / "r1", {
        "a": {"alone": 2.0, "shared": 3.0, "first": 5.0},
        "b": None,                                  # could not be rebuilt in round 1
        "c": {"alone": 1.0, "shared": 1.5, "first": 1.0}})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    merged = os.environ["EPL_CACHE_DIR"]
    assert merged != str(tmp_path / "r1")          # a folder of the merge's own
    _round(monkeypatch, tmp_path / "r2", {
        "a": {"alone": 1.5, "shared": 3.5, "first": 4.0},
        "b": {"alone": 7.0, "shared": 8.0, "first": 9.0},
        "c": None,
        "d": {"alone": 0.5, "shared": 0.5, "first": 0.5}})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    want = {"a": {"alone": 1.5, "shared": 3.0, "first": 4.0},
            "b": {"alone": 7.0, "shared": 8.0, "first": 9.0},
            "c": {"alone": 1.0, "shared": 1.5, "first": 1.0},
            "d": {"alone": 0.5, "shared": 0.5, "first": 0.5}}
    assert best == want
    with open(product_timing.cache_path()) as f:    # what the rows are priced with
        assert json.load(f) == want
    assert product_timing.timed(["a", "d"], 2) == {"a": want["a"], "d": want["d"]}


def test_a_light_kernel_keeps_its_mean_over_the_rounds(monkeypatch, tmp_path):
    """Microsecond kernels' least over the rounds priced the mini-BERT's step below
    every round's own pricing (stop 68); a heavy one (``HEAVY_S`` alone or first) still
    keeps its least, whichever round had it."""
    best, rounds = {}, {}
    light = lambda a, f: {"alone": a * 1e-6, "shared": a * 1e-6, "first": f * 1e-6}  # noqa
    heavy = lambda a: {"alone": a * 1e-3, "shared": a * 1e-3, "first": a * 1e-3}  # noqa
    _round(monkeypatch, tmp_path / "r1", {"l": light(2.0, 12.0), "h": heavy(3.0)})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    _round(monkeypatch, tmp_path / "r2", {"l": light(4.0, 8.0), "h": heavy(2.0),
                                           "n": None})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    _round(monkeypatch, tmp_path / "r3", {"l": None, "h": heavy(5.0)})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    for key, want in (("alone", 3e-6), ("shared", 3e-6), ("first", 10e-6)):
        assert abs(best["l"][key] - want) < 1e-12, (key, best["l"])
    assert best["h"] == heavy(2.0) and best["n"] is None
    with open(product_timing.cache_path()) as f:    # what the rows are priced with
        assert json.load(f)["l"]["alone"] == best["l"]["alone"]


def test_a_later_round_times_its_kernels_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """Round 2 on: ``price_all`` is called with the cache pointed at a new, empty folder
    (its kernels timed anew, not read from round 1's), and what it timed is merged."""
    best, rounds = {}, {}
    _round(monkeypatch, tmp_path / "r1", {"a": {"alone": 2.0, "shared": 3.0, "first": 5.0}})
    plan_accuracy.fastest_kernels(best, None, 0, rounds)
    merged = os.environ["EPL_CACHE_DIR"]
    seen = []

    def price_all():
        folder = os.environ["EPL_CACHE_DIR"]
        seen.append(folder)
        assert os.path.basename(folder).startswith("epl-plan-round2-")
        assert product_timing.cached_timings() == {}        # nothing of round 1's
        _round(monkeypatch, folder, {"a": {"alone": 1.0, "shared": 4.0, "first": 6.0}})
    plan_accuracy.fastest_kernels(best, price_all, 1, rounds)
    assert len(seen) == 1 and seen[0] not in (merged, str(tmp_path / "r1"))
    assert best == {"a": {"alone": 1.0, "shared": 3.0, "first": 5.0}}


def test_plan_multiprocess_keeps_a_cases_fastest_round(monkeypatch):
    import plan_multiprocess
    row = dict(step_s_rounds=[0.30, 0.20, 0.25], rows_per_step=64, failures=[
        ["timeout", "round 4"]])
    plan_multiprocess._settle(row)
    assert row["status"] == "ok" and row["step_s"] == 0.20
    assert abs(row["samples_per_s"] - 320.0) < 1e-9
    failed = dict(step_s_rounds=[], failures=[["error", "a"], ["timeout", "b"]])
    plan_multiprocess._settle(failed)
    assert failed["status"] == "timeout" and failed["message"] == "b"


def test_a_round_adds_its_step_and_keeps_the_largest_peak(capsys):
    row = dict(step_s_rounds=[], failures=[])
    assert not plan_accuracy.record_round(
        row, "ok", dict(step_s=0.3, peak_bytes=7, rows_per_step=64), "mlp DP 2", 0, 3)
    assert "(round 1 of 3) mlp DP 2: 300.00 ms" in capsys.readouterr().out
    assert not plan_accuracy.record_round(row, "timeout", "no step in 600 s", "mlp DP 2",
                                          1, 3)
    assert plan_accuracy.record_round(
        row, "ok", dict(step_s=0.2, peak_bytes=5, rows_per_step=64), "mlp DP 2", 2, 3)
    assert row == dict(step_s_rounds=[0.3, 0.2], failures=[["timeout", "no step in 600 s"]],
                       peak_bytes=7, rows_per_step=64)


def test_a_reprice_uses_the_runs_own_kernels_unless_a_cache_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("EPL_CACHE_DIR", "before")
    plan_accuracy.use_run_kernels(dict(kernels_folder=str(tmp_path)), None)
    assert os.environ["EPL_CACHE_DIR"] == str(tmp_path)
    plan_accuracy.use_run_kernels(dict(kernels_folder=str(tmp_path / "gone")), None)
    assert os.environ["EPL_CACHE_DIR"] == str(tmp_path)        # (a folder that is gone)
    monkeypatch.setenv("EPL_CACHE_DIR", "named")
    plan_accuracy.use_run_kernels(dict(kernels_folder=str(tmp_path)), "named")
    assert os.environ["EPL_CACHE_DIR"] == "named"
