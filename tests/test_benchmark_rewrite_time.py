"""benchmarks/rewrite_time.py reports what a user waits for, cold: each row is a fresh
process, with the graph build, the rewrite, TensorFlow's first runs and their sum."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.alone   # it times this machine (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_rewrite_time_table_is_cold_and_has_the_wait_columns(tmp_path):
    out = tmp_path / "rewrite_time.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rewrite_time.py"),
                           "--tiny", "--configs", "2x1", "--repeat", "2", "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    text = proc.stdout.decode()
    assert proc.returncode == 0, text[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    assert len({r["pid"] for r in rows}) == 2 and os.getpid() not in {r["pid"] for r in rows}
    for r in rows:
        for k in ("build_s", "rewrite_s", "init_run_s", "first_step_s", "tf_first_run_s",
                  "wait_s"):
            assert r[k] > 0, (k, r)
        assert abs(r["rewrite_vs_build"] - r["rewrite_s"] / r["build_s"]) < 1e-9
        assert abs(r["tf_first_run_s"] - r["init_run_s"] - r["first_step_s"]) < 1e-9
        assert abs(r["wait_s"] - r["build_s"] - r["rewrite_s"] - r["tf_first_run_s"]) < 1e-9
        assert r["ops_after"] > r["ops_before"] and r["import_floor_s"] > 0
    header = [ln for ln in text.splitlines() if ln.startswith("config") and "wait_s" in ln]
    assert header and all(c in header[-1] for c in ("build_s", "rewrite_s", "rewrite_vs_build",
                                                    "tf_first_run_s"))
    assert "cold" in text
