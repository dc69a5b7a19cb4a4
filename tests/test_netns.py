"""Multi-host jobs on a real (virtual) network: every host a network namespace with its own
address and link, one ``epl-launch --machine_list h0:7000,h1:7000 --machine_rank k`` per
host (tests/netns.py), the job's secret in EPL_JOB_SECRET; then 20 ms of added latency,
a partition mid-step, a host that never comes up and one that comes up late.

Every test measures the seconds to its outcome (printed; docs/network-faults.md has the
table) and checks that nothing is left running in the namespaces.  Skipped, with the
reason, where namespaces cannot be made (not root, no iproute2, no permission)."""
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from epl.launch import workers as launch_workers
from tests import models, netns
from tests.mw_train import BATCH, STEPS

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PORT = 7000             # every host's base port: worker 0 has TF on 7000, EPL on 7001
EPL_PORT = PORT + 1

_WHY = netns.unavailable()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


@pytest.fixture
def network(request):
    """A factory of Networks that the test's finalizer removes, however the test ends."""
    made = []

    def make(**kw):
        kw.setdefault("ports", [PORT, EPL_PORT])
        net = netns.Network(**kw)
        made.append(net)
        return net
    yield make
    for net in made:
        net.close()
        assert net.leftovers() == [], net.leftovers()


class Launch(object):
    """One host's epl-launch, its output read on a thread (waits can time out)."""

    def __init__(self, net, rank, script_args, tmp_path, timeout_seconds, secret):
        machines = ",".join("%s:%d" % (net.name(i), PORT) for i in range(net.hosts))
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   EPL_JOB_SECRET=secret,
                   EPL_COMMUNICATION_TIMEOUT_SECONDS=str(timeout_seconds))
        env.pop("EPL_JOB_ID", None)
        env.pop("EPL_COMM_TRANSPORT", None)
        self.rank, self.net = rank, net
        self.proc = net.popen(rank, [sys.executable, "-m", "epl.launch", "--num_workers",
                                     str(net.hosts), "--gpu_per_worker", "1",
                                     "--machine_list", machines, "--machine_rank", str(rank),
                                     "--log_dir", str(tmp_path / ("logs%d" % rank))]
                              + list(script_args),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              cwd=str(tmp_path))
        # The launch's run id (what its shared memory is named from), as the launchers of
        # a --machine_list job derive it: from the TF addresses (the job id) and the
        # secret (this job runs one attempt: 0).
        job = launch_workers.job_id_of(["%s:%d" % (net.name(i), PORT) for i in range(net.hosts)])
        net.add_run(launch_workers.shared_run_id(job, secret, 0))
        self.lines = []
        self.q = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            self.q.put(line)
        self.q.put(None)

    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.q.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            if text in line:
                return
        pytest.fail("host %d: no %r within %ds; output:\n%s"
                    % (self.rank, text, timeout, self.output()[-5000:]))

    def finish(self, timeout):
        """The launcher's exit code; fails the test (after killing it) if it hangs."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("host %d: epl-launch hung past %ds:\n%s"
                        % (self.rank, timeout, self.output()[-5000:]))
        deadline = time.time() + 10
        while not (self.lines and self.lines[-1] is not None) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)   # (the pump's last lines)
        # the runs it printed are those whose shared memory the Network checks and removes
        printed = re.findall(r"^epl-launch: attempt \d+: run ([0-9a-f]+)$", self.output(), re.M)
        assert set(printed) <= set(self.net.runs), (printed, self.net.runs)
        return code


def _secret():
    return uuid.uuid4().hex


def _assert_nothing_running(net):
    deadline = time.time() + 15   # (the launcher has stopped its workers; they exit)
    while net.pids() and time.time() < deadline:
        time.sleep(0.2)
    assert net.pids() == [], "still running in the namespaces: %s" % net.pids()


def _check_equal_local(tmp_path, workers):
    from tests.test_multi_worker import _check_workers
    _check_workers(tmp_path, workers, 1)


@needs_netns
@pytest.mark.parametrize("hosts,latency", [(2, 0.0), (2, 0.02), (3, 0.0)])
def test_hosts_train_equal_to_the_local_model(network, tmp_path, hosts, latency):
    """2 or 3 hosts, one worker each, EPL's TCP ring between them (through the relay with
    ``latency`` s each way): the job trains and equals the local model on the global
    batch, every worker and the chief's checkpoints."""
    net = network(hosts=hosts, latency=latency)
    secret = _secret()
    start = time.time()
    launches = [Launch(net, r, [os.path.join(HERE, "mw_train.py"), str(tmp_path)], tmp_path,
                       60, secret) for r in range(hosts)]
    codes = [h.finish(240) for h in launches]
    seconds = time.time() - start
    print("%d hosts, %g ms each way: the job took %.1f s" % (hosts, latency * 1000, seconds))
    assert codes == [0] * hosts, "\n".join(h.output()[-4000:] for h in launches)
    _check_equal_local(tmp_path, hosts)
    if latency:   # EPL's ring went through the relay (a connection to host 1's EPL port)
        assert net.relayed().get("%s:%d" % (net.relay_address(1), EPL_PORT), 0) >= 1, \
            net.relayed()
    _assert_nothing_running(net)


@needs_netns
def test_in_graph_pipeline_across_hosts_with_latency(network, tmp_path):
    """A 2-stage pipeline with stage 0 on host 0 and stage 1 on host 1, in-graph on
    TensorFlow's runtime: its gRPC (the TF ports of the machine list) goes through the
    relay with 20 ms each way; equals the local model with gradient accumulation."""
    from tests import mw_pipeline as mp
    net = network(hosts=2, latency=0.02)
    secret = _secret()
    os.environ["EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE"] = "false"
    try:
        launches = [Launch(net, r, [os.path.join(HERE, "mw_pipeline.py"), str(tmp_path)],
                           tmp_path, 60, secret) for r in range(2)]
    finally:
        del os.environ["EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE"]
    codes = [h.finish(240) for h in launches]
    assert codes == [0, 0], "\n".join(h.output()[-4000:] for h in launches)
    assert "serves its devices" in launches[1].output()
    assert net.relayed().get("%s:%d" % (net.relay_address(1), PORT), 0) >= 1, net.relayed()
    x, y = models.data(mp.STEPS * mp.MICRO * mp.MB)
    want, _ = models.train_local(x, y, mp.MICRO * mp.MB, mp.STEPS, "momentum")
    got = dict(np.load(str(tmp_path / "worker_0.npz")))
    assert int(got.pop("steps")) == mp.STEPS
    devices = [str(d) for d in got.pop("devices")]
    assert any("task:1" in d for d in devices), devices
    models.assert_weights_close(got, want)
    _assert_nothing_running(net)


TIMEOUT = 10   # communication.timeout_seconds of the fault tests


@needs_netns
def test_partition_mid_step_names_the_unreachable_host(network, tmp_path):
    """Host 1's link goes down while both hosts are training (steps back to back, so the
    cut lands inside a step's collectives): a partition is silent, so each side can tell
    it only by the collective timeout (communication.timeout_seconds); then each host's
    job ends with an error that names the other host, and nothing is left running."""
    net = network(hosts=2)
    secret = _secret()
    hosts = [Launch(net, r, [os.path.join(HERE, "fault_train.py")], tmp_path, TIMEOUT, secret)
             for r in range(2)]
    for h in hosts:
        h.wait_for("[worker %d] step 3" % h.rank, 120)
    net.cut(1)
    cut = time.time()
    codes = [h.finish(TIMEOUT + 60) for h in hosts]
    seconds = time.time() - cut
    print("partition: both hosts' jobs ended %.1f s after the cut (timeout %d s)"
          % (seconds, TIMEOUT))
    out0, out1 = hosts[0].output(), hosts[1].output()
    assert codes[0] != 0 and codes[1] != 0, out0[-3000:] + out1[-3000:]
    summary0 = out0[out0.index("epl-launch summary"):]
    summary1 = out1[out1.index("epl-launch summary"):]
    assert "h1:%d" % EPL_PORT in summary0, summary0      # host 0 names host 1
    assert "h0:%d" % EPL_PORT in summary1, summary1      # and host 1 names host 0
    assert "communication.timeout_seconds" in summary0, summary0
    assert seconds < TIMEOUT + 15, seconds
    _assert_nothing_running(net)


@needs_netns
def test_partition_mid_transfer_of_a_large_all_reduce(network):
    """The link goes down while 64 MiB all-reduces stream between the hosts: a send
    blocked on a full socket buffer must not outlast the collective timeout (the kernel
    would retry for about 15 minutes).  Both ranks fail within the bound, each naming
    the other host; the sums before the cut were right."""
    net = network(hosts=2)
    job = uuid.uuid4().hex[:12]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", EPL_JOB_SECRET=_secret(),
               EPL_COMM_ADDRESSES=",".join("%s:%d" % (net.name(i), EPL_PORT)
                                           for i in range(2)))
    procs = [net.popen(r, [sys.executable, os.path.join(HERE, "netns_allreduce.py"), str(r),
                           "2", "64", job, str(TIMEOUT)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for r in range(2)]
    ranks = []
    for r, p in enumerate(procs):
        h = Launch.__new__(Launch)   # (only its output reader)
        h.rank, h.net, h.proc, h.lines, h.q = r, net, p, [], queue.Queue()
        threading.Thread(target=h._pump, daemon=True).start()
        ranks.append(h)
    for h in ranks:
        h.wait_for("round 2 3 3", 120)
    net.cut(1)
    cut = time.time()
    codes = [h.finish(TIMEOUT + 60) for h in ranks]
    seconds = time.time() - cut
    print("partition mid-transfer: both ranks failed %.1f s after the cut (timeout %d s)"
          % (seconds, TIMEOUT))
    out0, out1 = ranks[0].output(), ranks[1].output()
    for out in (out0, out1):
        print([l for l in out.splitlines() if l.startswith("EPL ") or "Error: EPL" in l][-1:])
    assert codes[0] != 0 and codes[1] != 0, out0[-2000:] + out1[-2000:]
    assert "h1:%d" % EPL_PORT in out0, out0[-3000:]
    assert "h0:%d" % EPL_PORT in out1, out1[-3000:]
    assert seconds < TIMEOUT + 15, seconds
    _assert_nothing_running(net)


@needs_netns
def test_a_host_that_never_comes_up_is_named(network, tmp_path):
    """Host 1 is off (its link down, nothing runs there): host 0's worker tries to reach
    it until the start-up bound (communication.timeout_seconds) and fails naming it."""
    net = network(hosts=2)
    net.cut(1)
    start = time.time()
    host = Launch(net, 0, [os.path.join(HERE, "mw_train.py"), str(tmp_path)], tmp_path,
                  TIMEOUT, _secret())
    code = host.finish(TIMEOUT + 120)
    seconds = time.time() - start
    out = host.output()
    print("a host that never comes up: host 0's job ended after %.1f s (timeout %d s)"
          % (seconds, TIMEOUT))
    assert code != 0, out[-3000:]
    summary = out[out.index("epl-launch summary"):]
    assert "h1:%d" % EPL_PORT in summary, summary
    assert "within %d s (communication.timeout_seconds" % TIMEOUT in summary, summary
    _assert_nothing_running(net)


@needs_netns
def test_a_host_that_comes_up_late_joins_the_job(network, tmp_path):
    """Host 1 is off when host 0 starts and comes up (link up, then its launcher) well
    within the start-up bound: the job runs and equals the local model."""
    net = network(hosts=2)
    net.cut(1)
    secret = _secret()
    start = time.time()
    first = Launch(net, 0, [os.path.join(HERE, "mw_train.py"), str(tmp_path)], tmp_path, 60,
                   secret)
    time.sleep(12)
    net.restore(1)
    late = Launch(net, 1, [os.path.join(HERE, "mw_train.py"), str(tmp_path)], tmp_path, 60,
                  secret)
    codes = [first.finish(240), late.finish(240)]
    print("a host 12 s late: the job took %.1f s" % (time.time() - start))
    assert codes == [0, 0], first.output()[-4000:] + late.output()[-4000:]
    _check_equal_local(tmp_path, 2)
    _assert_nothing_running(net)


def test_the_launcher_names_the_message_of_a_tf2_graph_execution_error(tmp_path):
    """TF 2.x prints 'XError: Graph execution error:' and the op's message lines later
    (after "Node: 'name'"): the launcher's summary shows that message, which names the
    unreachable host, not 'Graph execution error:'."""
    from epl.launch.triage import exception_line
    log = tmp_path / "worker_0.log"
    log.write_text("step 3\n"
                   "tensorflow.python.framework.errors_impl.DeadlineExceededError: Graph "
                   "execution error:\n\nDetected at node 'EplAllReduceN' defined at:\n"
                   "  File \"x.py\", line 3, in <module>\nNode: 'EplAllReduceN'\n"
                   "EPL all_reduce_n: rank 1 (h1:7001) sent nothing within 10 s\n"
                   "\t [[{{node EplAllReduceN}}]]\n")
    assert exception_line(str(log)) == ("tensorflow.python.framework.errors_impl."
                                         "DeadlineExceededError: EPL all_reduce_n: rank 1 "
                                         "(h1:7001) sent nothing within 10 s")
