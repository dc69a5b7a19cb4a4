"""``epl.init`` keeps the host memory TensorFlow frees (epl/core/host_heap.py).

Stop 61, AMD EPYC, TF 1.15: glibc's malloc gave the memory of a step's freed tensors
back to the kernel and the next step faulted it in again.  The MLP of
benchmarks/plan_accuracy.py (4 x 1024, batch 64, Adam) took 0-2,700 minor faults a step
(which thread frees a tensor first decides it) and 14.2-16.0 ms; with the thresholds
kept, 0 faults and 12.8-13.2 ms.  The GPT
decoder: 18,394 faults and 155 ms against 33 and 138 ms.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from epl.core import config, host_heap

_MLP_STEPS = textwrap.dedent("""
    import json, os, resource, statistics, sys
    import tensorflow as tf
    v1 = tf.compat.v1
    if tf.__version__.startswith("2."):     # the suite's graph mode (tests/conftest.py)
        if os.environ.get("EPL_TEST_GRAPH_MODE") == "eager_off":
            v1.disable_eager_execution()
        else:
            v1.disable_v2_behavior()
    import epl
    from epl.core import host_heap
    keep = json.loads(sys.argv[1])
    epl.init(epl.Config({} if keep is None else {"cluster.keep_freed_host_memory": keep}))
    rng = v1.random_normal_initializer(stddev=0.02)
    h = v1.random_normal([64, 1024], seed=1)
    for i in range(4):
        w = v1.get_variable("w%d" % i, [1024, 1024], initializer=rng)
        h = tf.nn.relu(tf.matmul(h, w))
    loss = tf.reduce_mean(tf.square(h))
    step = v1.train.AdamOptimizer(1e-4).minimize(loss)
    faults = []
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for _ in range(5):
            sess.run(step)
        for _ in range(20):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            sess.run(step)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": host_heap.kept(), "faults": statistics.median(faults)}))
""")


def _steps(keep):
    out = subprocess.run([sys.executable, "-c", _MLP_STEPS, json.dumps(keep)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_BLOCKS = textwrap.dedent("""
    import ctypes, json, resource, sys
    from epl.core import host_heap
    if sys.argv[1] == "keep":
        host_heap.keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(4):              # a "step": ten 3 MiB tensors, written, then freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(3 << 20) for _ in range(10)]
        for b in blocks:
            ctypes.memset(b, 1, 3 << 20)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        for b in blocks:
            libc.free(b)
    print(json.dumps(faults))
""")


def _block_faults(mode):
    out = subprocess.run([sys.executable, "-c", _BLOCKS, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_are_faulted_in_again_unless_kept():
    """The mechanism, without TensorFlow's timing: 30 MiB of 3 MiB blocks, written and
    freed four times.  glibc as it comes trims them at every free (7,648 faults each
    time here: every page again); kept, only the first time faults."""
    if not host_heap.available():
        pytest.skip("not glibc: its allocator has no such thresholds")
    pages = (30 << 20) // os.sysconf("SC_PAGE_SIZE")
    plain, kept = _block_faults("plain"), _block_faults("keep")
    assert min(plain[1:]) > pages // 2, plain
    assert kept[0] > pages // 2 and max(kept[1:]) < pages // 20, kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_epl_init_keeps_the_heap_and_a_step_faults_no_pages_in():
    """By default: the thresholds are set, and a step of the MLP faults (almost) no page
    in (without them, 0-2,400 a step on TF 1.15 here: it depends on which thread frees
    a tensor first, so that leg is the blocks' test above)."""
    if not host_heap.available():
        pytest.skip("not glibc: its allocator has no such thresholds")
    got = _steps(None)
    assert got["kept"] is True
    assert got["faults"] < 100, got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_key_off_leaves_malloc_as_it_is():
    got = _steps(False)
    assert got["kept"] is False


def test_the_key_is_a_documented_bool_that_defaults_on():
    key = [k for k in config.SCHEMA if k.name == "cluster.keep_freed_host_memory"]
    assert len(key) == 1 and key[0].default is True
    with pytest.raises(Exception, match="keep_freed_host_memory"):
        config.Config({"cluster.keep_freed_host_memory": "sometimes"})
