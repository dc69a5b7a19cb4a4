"""Job discovery from a cluster manager's environment (epl/core/job_env.py) and the
rendezvous of the tasks it started (epl/core/rendezvous.py), without the managers: their
real programs are in tests/test_cluster_managers.py."""
import json
import threading

import pytest

from epl.core import job_env, rendezvous
from epl.core.job_env import JobEnvError, discover, expand_hostlist, expand_tasks_per_node

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)


# -- hostlists ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("a[1-2],b,c[3]", ["a1", "a2", "b", "c3"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("localhost", ["localhost"]),
    (" x1 , x2 ", ["x1", "x2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", "node[1,,2]"])
def test_bad_hostlist_is_named(text):
    with pytest.raises(JobEnvError, match="hostlist"):
        expand_hostlist(text)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(JobEnvError, match="TASKS_PER_NODE"):
        expand_tasks_per_node("two")


# -- discovery ----------------------------------------------------------------------------

def slurm(rank, size=4, **more):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_STEP_NUM_TASKS":
           str(size), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
           "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_JOB_NODELIST": "node[01-03]",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0"}
    env.update(more)
    return env


def test_nothing_is_no_job():
    assert discover({}) is None


def test_tf_config_comes_first():
    env = slurm(1, TF_CONFIG=json.dumps({"cluster": {"worker": ["a:1"]}}))
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    assert discover(env).source == job_env.TF_CONFIG


def test_slurm_task():
    job = discover(slurm(3))
    assert job.source == job_env.SLURM
    assert (job.rank, job.size, job.local_rank, job.local_size, job.node_id) == (3, 4, 1, 2, 1)
    assert job.hosts == ["node01", "node02"]   # the step's nodes, not the allocation's
    assert job.host == "node02" and job.multi_node
    assert job.key == "slurm-1234.0"
    assert "Slurm: task 3 of 4" in job_env.describe(job)


def test_slurm_steps_and_jobs_have_their_own_keys():
    keys = {discover(slurm(0, SLURM_JOB_ID=j, SLURM_STEP_ID=s)).key
            for j in ("1", "2") for s in ("0", "1")}
    assert len(keys) == 4


def test_slurm_one_node_and_job_nodelist_fallback():
    env = slurm(1, size=2, SLURM_NODEID="0", SLURM_STEP_NUM_NODES="1",
                SLURM_STEP_TASKS_PER_NODE="2", SLURMD_NODENAME="localhost")
    del env["SLURM_STEP_NODELIST"]
    job = discover(env)
    assert job.multi_node is False and job.local_size == 2 and job.host == "localhost"
    assert job.hosts == ["node01", "node02", "node03"]


def test_slurm_batch_shell_is_not_a_task():
    env = slurm(0)
    del env["SLURM_STEP_ID"]
    assert discover(env) is None


def test_slurm_single_task_is_alone():
    assert discover(slurm(0, size=1)) is None


def test_slurm_errors_are_named():
    with pytest.raises(JobEnvError, match="SLURM_PROCID='x'"):
        discover(slurm(0, SLURM_PROCID="x"))
    with pytest.raises(JobEnvError, match="rank 5 is outside the job's 4 tasks"):
        discover(slurm(5))
    env = slurm(0)
    del env["SLURM_JOB_ID"]
    with pytest.raises(JobEnvError, match="SLURM_JOB_ID"):
        discover(env)


def ompi(rank, size=2, local_size=2, **more):
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
           "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "PMIX_NAMESPACE": "prterun-h-1@1"}
    env.update(more)
    return env


def test_open_mpi():
    job = discover(ompi(1))
    assert job.source == job_env.OPEN_MPI
    assert (job.rank, job.size, job.local_rank, job.local_size) == (1, 2, 1, 2)
    assert job.multi_node is False and job.key == "ompi-prterun-h-1_1"
    assert discover(ompi(3, size=4, local_size=2)).multi_node


def test_mpirun_inside_slurm_allocation_is_mpi():
    env = ompi(1)
    env.update(slurm(0, size=1))   # the allocation's daemon step, not the ranks
    assert discover(env).source == job_env.OPEN_MPI


def test_mpi_without_job_id_is_named_by_the_launcher():
    env = ompi(0)
    del env["PMIX_NAMESPACE"]
    assert discover(env, ppid=4321).key == "ompi-ppid4321"
    with pytest.raises(JobEnvError, match="no job id"):
        discover(env)


def test_pmi_and_pmix():
    job = discover({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1",
                    "MPI_LOCALNRANKS": "3"}, ppid=7)
    assert (job.source, job.rank, job.size, job.multi_node, job.key) == \
        (job_env.PMI, 1, 3, False, "pmi-ppid7")
    job = discover({"PMIX_RANK": "0", "PMIX_SIZE": "2", "PMIX_NAMESPACE": "ns"})
    assert (job.source, job.size, job.key) == (job_env.PMIX, 2, "pmix-ns")
    with pytest.raises(JobEnvError, match="size"):
        discover({"PMIX_RANK": "0", "PMIX_NAMESPACE": "ns"})


# -- rendezvous ---------------------------------------------------------------------------

def _meet(jobs, folder, timeout=10):
    out, errors = {}, []

    def run(job):
        try:
            out[job.rank] = rendezvous.exchange(job, folder, "127.0.0.1", timeout, poll=0.01)
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out, errors


def test_rendezvous_builds_the_launcher_environment(tmp_path):
    jobs = [discover(slurm(r, size=3, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
            for r in range(3)]
    folder = rendezvous.folder_for(jobs[0], {"EPL_RENDEZVOUS_DIR": str(tmp_path)})
    assert folder == str(tmp_path / "slurm-1234.0")
    out, errors = _meet(jobs, folder)
    assert not errors and sorted(out) == [0, 1, 2]
    envs = [rendezvous.job_environment(j, out[j.rank]) for j in jobs]
    tf_configs = [json.loads(e["TF_CONFIG"]) for e in envs]
    assert [c["task"]["index"] for c in tf_configs] == [0, 1, 2]
    assert len({json.dumps(c["cluster"]) for c in tf_configs}) == 1
    workers = tf_configs[0]["cluster"]["worker"]
    comm = envs[0]["EPL_COMM_ADDRESSES"].split(",")
    assert len(set(workers + comm)) == 6   # every port its own
    for key in ("EPL_COMM_ADDRESSES", "EPL_JOB_ID", "EPL_RUN_ID", "EPL_JOB_SECRET"):
        assert len({e[key] for e in envs}) == 1


def _bindable(port):
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_a_tasks_ports_stay_its_own_until_the_meeting_is_over(tmp_path):
    """A task's two ports stay bound while it waits for the others, so that no other
    task on the node draws them (CI: one task's server port was another's collectives
    port), and are free for its servers once every task has met."""
    import os
    import time
    jobs = [discover(slurm(r, size=2, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
            for r in range(2)]
    folder = str(tmp_path / "meet")
    out, errors = {}, []

    def run(job):
        try:
            out[job.rank] = rendezvous.exchange(job, folder, "127.0.0.1", 20, poll=0.01)
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)
    first = threading.Thread(target=run, args=(jobs[0],))
    first.start()
    mine = os.path.join(folder, "rank_0.json")
    deadline = time.time() + 20
    while not os.path.exists(mine) and time.time() < deadline:
        time.sleep(0.01)
    record = json.loads(open(mine).read())
    ports = [record["tf_port"], record["comm_port"]]
    assert ports[0] != ports[1]
    assert not any(_bindable(p) for p in ports), "rank 0's ports were free mid-meeting"
    run(jobs[1])
    first.join(20)
    assert not errors and sorted(out) == [0, 1], errors
    assert all(_bindable(p) for p in ports)


def test_a_tcp_meeting_holds_each_tasks_ports_while_it_meets(monkeypatch):
    held = []
    for name in ("serve", "join"):
        real = getattr(rendezvous_tcp, name)

        def check(*args, real=real, **kw):
            record = [a for a in args if isinstance(a, dict) and "tf_port" in a][0]
            held.append(not _bindable(record["tf_port"])
                        and not _bindable(record["comm_port"]))
            return real(*args, **kw)
        monkeypatch.setattr(rendezvous_tcp, name, check)
    envs = _tcp_envs(2, _free_tcp_port(), EPL_JOB_SECRET="s3cret")
    jobs, errors = _meet_tcp(envs)
    assert not errors and sorted(jobs) == [0, 1], errors
    assert held == [True, True]
    for e in envs:
        assert all(_bindable(int(a.rsplit(":", 1)[1]))
                   for a in e["EPL_COMM_ADDRESSES"].split(","))


def test_two_steps_on_one_node_never_meet(tmp_path):
    """Two steps of one job (and a second job) rendezvous at once on one node: each
    sees only its own tasks."""
    env = {"EPL_RENDEZVOUS_DIR": str(tmp_path)}
    groups = [[discover(slurm(r, size=2, SLURM_JOB_ID=j, SLURM_STEP_ID=s,
                              SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
               for r in range(2)] for j, s in (("7", "0"), ("7", "1"), ("8", "0"))]
    results = {}
    threads = [threading.Thread(target=lambda g=g: results.__setitem__(
        g[0].key, _meet(g, rendezvous.folder_for(g[0], env)))) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    secrets_seen = set()
    for key, (out, errors) in results.items():
        assert not errors, errors
        envs = [rendezvous.job_environment(g, out[g.rank])
                for grp in groups for g in grp if g.key == key]
        assert len({e["EPL_JOB_SECRET"] for e in envs}) == 1
        secrets_seen.add(envs[0]["EPL_JOB_SECRET"])
    assert len(results) == 3 and len(secrets_seen) == 3
    assert len({rendezvous.job_environment(g[0], results[g[0].key][0][0])["EPL_JOB_ID"]
                for g in groups}) == 3


def test_missing_rank_is_named_within_the_timeout(tmp_path):
    job = discover(slurm(0, size=3, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
    with pytest.raises(rendezvous.RendezvousError, match=r"rank\(s\) 1, 2 did not reach"):
        rendezvous.exchange(job, str(tmp_path), "127.0.0.1", 0.3, poll=0.01)


def test_stale_record_of_a_dead_task_is_ignored(tmp_path):
    import socket
    (tmp_path / "rank_1.json").write_text(json.dumps(
        {"host": "127.0.0.1", "tf_port": 1, "comm_port": 2, "pid": 2 ** 22 + 12345,
         "node": socket.gethostname()}))
    job = discover(slurm(0, size=2, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
    with pytest.raises(rendezvous.RendezvousError, match=r"rank\(s\) 1 did not"):
        rendezvous.exchange(job, str(tmp_path), "127.0.0.1", 0.3, poll=0.01)


def test_folders():
    one = discover(slurm(0, size=2, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
    assert rendezvous.folder_for(one, {}, uid=5) == "/tmp/epl-rendezvous-5/slurm-1234.0"
    multi = discover(slurm(0))
    assert rendezvous.folder_for(multi, {"SLURM_SUBMIT_DIR": "/home/u/run"}) == \
        "/home/u/run/.epl-rendezvous/slurm-1234.0"
    with pytest.raises(rendezvous.RendezvousError, match="EPL_RENDEZVOUS_DIR"):
        rendezvous.folder_for(discover(ompi(3, size=4, local_size=2)), {})


def test_local_gpus():
    job = discover(slurm(3))   # local rank 1
    assert rendezvous.local_gpus(job, {}, 0, "auto") == "1"
    assert rendezvous.local_gpus(job, {}, 2, "gpu") == "2,3"
    assert rendezvous.local_gpus(job, {"CUDA_VISIBLE_DEVICES": "5"}, 0, "auto") is None
    assert rendezvous.local_gpus(job, {}, 2, "cpu") is None


class _Config(object):
    def __init__(self, **values):
        self.values = {"cluster.devices_per_worker": 0, "cluster.device_type": "cpu"}
        self.values.update(values)

    def get(self, key):
        return self.values[key]


def test_meet_sets_what_epl_launch_would(tmp_path):
    envs = [slurm(r, size=2, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0",
                  EPL_RENDEZVOUS_DIR=str(tmp_path)) for r in range(2)]
    envs[1]["EPL_JOB_SECRET"] = envs[0]["EPL_JOB_SECRET"] = "given"
    jobs = {}
    threads = [threading.Thread(target=lambda e=e, r=r: jobs.__setitem__(
        r, rendezvous.meet(_Config(), e))) for r, e in enumerate(envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(jobs) == [0, 1]
    for r, env in enumerate(envs):
        assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": r}
        assert env["EPL_JOB_SECRET"] == "given"   # the user's stays
        assert "CUDA_VISIBLE_DEVICES" not in env  # a CPU job
    assert envs[0]["EPL_COMM_ADDRESSES"] == envs[1]["EPL_COMM_ADDRESSES"]
    assert envs[0]["EPL_RUN_ID"] == envs[1]["EPL_RUN_ID"]
    # Now TF_CONFIG describes the job: a second look finds it there.
    assert rendezvous.meet(_Config(), envs[0]).source == job_env.TF_CONFIG
    assert rendezvous.meet(_Config(), {}) is None


def test_task_host():
    one = discover(slurm(0, size=2, SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0"))
    assert rendezvous.task_host(one, {}) == "127.0.0.1"
    multi = discover(slurm(0))
    assert rendezvous.task_host(multi, {"EPL_TASK_HOST": "10.0.0.5"}) == "10.0.0.5"
    # The route to srun's node on loopback says nothing: the node's name.
    assert rendezvous.task_host(multi, {"SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}) == "node01"
    assert rendezvous.task_host(multi, {}) == "node01"


# -- the TCP meeting point ----------------------------------------------------------------

from epl.core import rendezvous_tcp  # noqa: E402


def test_meeting_ports_of_concurrent_steps_and_jobs_differ():
    """Steps less than 64 apart of one job, and jobs less than 256 apart, never share a
    port; every port is below Linux's ephemeral range."""
    ports = {rendezvous_tcp.port_for("slurm-%d.%d" % (j, s))
             for j in range(4711, 4711 + 256) for s in range(64)}
    assert len(ports) == 256 * 64
    assert min(ports) >= 16384 and max(ports) < 32768
    assert rendezvous_tcp.port_for("ompi-ns") == rendezvous_tcp.port_for("ompi-ns")


def test_meeting_method_and_address():
    multi, one = discover(slurm(3)), discover(slurm(0, size=2, SLURM_STEP_NUM_NODES="1",
                                                     SLURM_NODEID="0"))
    assert rendezvous.method_for(multi, {}) == "tcp"   # no shared folder known
    assert rendezvous.method_for(multi, {"EPL_RENDEZVOUS_DIR": "/shared"}) == "file"
    assert rendezvous.method_for(one, {}) == "file"
    assert rendezvous.method_for(one, {"EPL_RENDEZVOUS": "TCP"}) == "tcp"
    with pytest.raises(rendezvous.RendezvousError, match="EPL_RENDEZVOUS='udp'"):
        rendezvous.method_for(one, {"EPL_RENDEZVOUS": "udp"})
    # The first task of the node list's first node listens, at a port of the job step.
    assert [rendezvous_tcp.serves(discover(slurm(r))) for r in range(4)] == \
        [True, False, False, False]
    assert rendezvous_tcp.address(multi, {}) == ("node01", rendezvous_tcp.port_for(
        "slurm-1234.0"))
    assert rendezvous_tcp.address(multi, {"EPL_RENDEZVOUS_HOST": "10.1.1.1",
                                          "EPL_RENDEZVOUS_PORT": "2000"}) == ("10.1.1.1", 2000)
    with pytest.raises(rendezvous.RendezvousError, match="EPL_RENDEZVOUS_HOST"):
        rendezvous_tcp.address(discover(ompi(3, size=4, local_size=2)), {})


def _free_tcp_port():
    import socket
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _meet_tcp(envs, timeout=20):
    """rendezvous.meet of every environment, each in a thread: ({rank: job}, [errors])."""
    jobs, errors = {}, []

    def run(r, env):
        try:
            jobs[r] = rendezvous.meet(_Config(), env)
        except Exception as e:   # noqa: BLE001 (reported by the tests)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r, e)) for r, e in enumerate(envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "the TCP meeting hung"
    return jobs, errors


def _tcp_envs(size, port, **more):
    envs = []
    for r in range(size):
        env = slurm(r, size=size, SLURM_STEP_TASKS_PER_NODE="%d" % size, SLURM_NODEID="0",
                    SLURM_LOCALID=str(r), SLURM_STEP_NUM_NODES="1",
                    SLURM_STEP_NODELIST="localhost", EPL_RENDEZVOUS="tcp",
                    EPL_RENDEZVOUS_PORT=str(port))
        env.update(more)
        envs.append(env)
    return envs


def test_tcp_meeting_builds_the_launcher_environment():
    """Three tasks meet at the first's port (authenticated by the job's secret): each gets
    the same cluster, its own index, distinct ports; no folder is used."""
    envs = _tcp_envs(3, _free_tcp_port(), EPL_JOB_SECRET="s3cret")
    jobs, errors = _meet_tcp(envs)
    assert not errors and sorted(jobs) == [0, 1, 2], errors
    configs = [json.loads(e["TF_CONFIG"]) for e in envs]
    assert [c["task"]["index"] for c in configs] == [0, 1, 2]
    assert len({json.dumps(c["cluster"]) for c in configs}) == 1
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers + envs[0]["EPL_COMM_ADDRESSES"].split(","))) == 6
    for key in ("EPL_COMM_ADDRESSES", "EPL_JOB_ID", "EPL_RUN_ID"):
        assert len({e[key] for e in envs}) == 1
    assert {e["EPL_JOB_SECRET"] for e in envs} == {"s3cret"}


def test_tcp_meeting_names_the_missing_rank_on_every_task():
    """Rank 2 never comes: after the timeout the listener names it, and so does the task
    that waited at the listener, within the timeout (plus a moment)."""
    import time
    envs = _tcp_envs(3, _free_tcp_port(), EPL_RENDEZVOUS_TIMEOUT="1")[:2]
    start = time.time()
    _, errors = _meet_tcp(envs)
    assert len(errors) == 2, errors
    for e in errors:
        assert isinstance(e, rendezvous.RendezvousError)
        assert "rank(s) 2 did not reach the rendezvous at localhost:" in str(e), e
    assert time.time() - start < 5


def test_tcp_meeting_without_its_listener_names_it():
    import time
    env = _tcp_envs(2, _free_tcp_port(), EPL_RENDEZVOUS_TIMEOUT="0.5")[1]
    start = time.time()
    with pytest.raises(rendezvous.RendezvousError,
                       match=r"the meeting point localhost:\d+ \(the first task of node "
                             r"localhost listens there\) did not answer within"):
        rendezvous.meet(_Config(), env)
    assert time.time() - start < 3


def test_tcp_meeting_refuses_a_task_without_the_secret():
    """A task (or a stranger) that cannot prove EPL_JOB_SECRET is refused: it never gets
    the records, and the listener names its rank as missing."""
    port = _free_tcp_port()
    envs = _tcp_envs(2, port, EPL_JOB_SECRET="right", EPL_RENDEZVOUS_TIMEOUT="1.5")
    envs[1]["EPL_JOB_SECRET"] = "wrong"
    jobs, errors = _meet_tcp(envs)
    assert not jobs and len(errors) == 2, (jobs, errors)
    assert any("rank(s) 1 did not reach" in str(e) for e in errors), errors
    assert "TF_CONFIG" not in envs[1]


def test_tcp_meeting_of_another_job_on_the_port_is_named():
    """Two steps that would share a port (forced here) never mix: the second step's task
    sees the first's key and stops, named; a second listener cannot take the port."""
    port = _free_tcp_port()
    first = _tcp_envs(2, port, EPL_RENDEZVOUS_TIMEOUT="2")
    other = _tcp_envs(2, port, SLURM_STEP_ID="1", EPL_RENDEZVOUS_TIMEOUT="2")
    out = {}
    t = threading.Thread(target=lambda: out.update(first=_meet_tcp(first[:1])))
    t.start()
    import time
    time.sleep(0.3)   # (the first step's listener is up)
    with pytest.raises(rendezvous.RendezvousError, match="is the meeting point of job "
                                                         "'slurm-1234.0', not of this one"):
        rendezvous.meet(_Config(), other[1])
    with pytest.raises(rendezvous.RendezvousError, match="port %d is taken" % port):
        rendezvous.meet(_Config(), other[0])
    t.join(10)
