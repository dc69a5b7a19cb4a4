"""C++ collectives across processes (shm transport) against numpy."""
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from tests import xproc_collectives_worker as W

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(size, tmp_path, script, extra=(), timeout=180, env_extra=None):
    """Start `size` processes of `script` and wait; on failure print every log."""
    job = uuid.uuid4().hex[:12]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TF_CPP_MIN_LOG_LEVEL="2")
    env.update(env_extra or {})
    procs, logs, outs = [], [], []
    for r in range(size):
        out = str(tmp_path / ("rank%d.npz" % r))
        log = open(str(tmp_path / ("rank%d.log" % r)), "w+")
        procs.append(subprocess.Popen([sys.executable, script, str(r), str(size), job, out]
                                      + list(extra), stdout=log, stderr=subprocess.STDOUT,
                                      env=env))
        logs.append(log)
        outs.append(out)
    failed = False
    try:
        for p in procs:
            p.wait(timeout=timeout)
            failed |= p.returncode != 0
    except subprocess.TimeoutExpired:
        failed = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for r, log in enumerate(logs):
        log.seek(0)
        texts.append(log.read())
        log.close()
    if failed:
        pytest.fail("ranks failed or hung:\n" + "\n".join(
            "---- rank %d ----\n%s" % (r, t[-3000:]) for r, t in enumerate(texts)))
    return [np.load(o) for o in outs], texts


def _tol(dtype):
    return {"float16": dict(rtol=1e-2, atol=1e-1),
            "float32": dict(rtol=1e-5, atol=1e-4)}.get(dtype, dict(rtol=1e-12, atol=1e-9))


@pytest.mark.parametrize("size, transport", [(2, "shm"), (3, "shm"), (2, "tcp"), (3, "tcp")])
def test_all_ops_across_processes(size, transport, tmp_path):
    env = {}
    if transport == "tcp":
        from epl.launch.ports import free_ports
        env["EPL_COMM_ADDRESSES"] = ",".join("127.0.0.1:%d" % p for p in free_ports(size))
    results, _ = run_ranks(size, tmp_path, os.path.join(HERE, "xproc_collectives_worker.py"),
                           extra=[transport], env_extra=env)
    for name, kind, dtype, shape, seed in W.cases(size):
        if kind == "all_gather":
            xs = [W.inputs(r, (W.gather_rows(r, name), 3), dtype, seed) for r in range(size)]
        else:
            xs = [W.inputs(r, shape, dtype, seed) for r in range(size)]
        wide = np.stack([x.astype(np.float64) for x in xs]) if kind != "all_gather" else None
        for r in range(size):
            got = results[r][name]
            if kind in ("all_reduce", "all_reduce_n"):
                np.testing.assert_allclose(got.astype(np.float64), wide.sum(0), err_msg=name,
                                           **_tol(dtype))
            elif kind == "all_reduce_mean":   # (integers truncate toward zero)
                want = wide.sum(0) / size
                if np.dtype(dtype).kind == "i":
                    np.testing.assert_array_equal(got, np.fix(want).astype(dtype), err_msg=name)
                else:
                    np.testing.assert_allclose(got.astype(np.float64), want, err_msg=name,
                                               **_tol(dtype))
            elif kind == "all_reduce_max":
                np.testing.assert_array_equal(got, np.max(np.stack(xs), 0), err_msg=name)
            elif kind == "all_gather":
                np.testing.assert_array_equal(got, np.concatenate(xs), err_msg=name)
            elif kind == "reduce_scatter":
                want = np.array_split(wide.sum(0), size)[r]
                np.testing.assert_allclose(got.astype(np.float64), want, err_msg=name,
                                           **_tol(dtype))
            elif kind == "broadcast":
                np.testing.assert_array_equal(got, xs[size - 1], err_msg=name)
            elif kind == "reduce":
                if r == 0:
                    np.testing.assert_allclose(got.astype(np.float64), wide.sum(0),
                                               err_msg=name, **_tol(dtype))
                else:
                    assert not got.any(), name
            elif kind == "all_to_all":
                want = np.concatenate([np.split(xs[s], size)[r] for s in range(size)])
                np.testing.assert_array_equal(got, want, err_msg=name)
            else:
                parts = [np.split(xs[s], np.cumsum(W.split_sizes(s, size, len(xs[s])))[:-1])[r]
                         for s in range(size)]
                np.testing.assert_array_equal(got, np.concatenate(parts), err_msg=name)


def test_missing_process_times_out_naming_rank(tmp_path):
    """Rank 1 of 2 never starts: rank 0 fails within the timeout and names rank 1."""
    code = ("import sys, tensorflow.compat.v1 as tf\ntf.disable_v2_behavior()\n"
            "from epl.communicators import native_ops as C\n"
            "y = C.all_reduce(tf.ones([8]), sys.argv[1] + '/lonely', 0, 2, timeout_seconds=2,"
            " transport='shm')\n"
            "try:\n    tf.Session().run(y)\nexcept tf.errors.DeadlineExceededError as e:\n"
            "    print('TIMEOUT', [l for l in e.message.splitlines() if 'rank(s)' in l][0])\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", code, uuid.uuid4().hex], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    text = out.stdout.decode()
    assert "TIMEOUT" in text and "rank(s) 1 of 2" in text, text
