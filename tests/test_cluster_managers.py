"""The unchanged multi-worker programs under real cluster managers, without epl-launch:
``mpirun -np 2`` (Open MPI) and ``srun -n 2`` on a one-node Slurm cluster this module
starts (munged, slurmctld, slurmd as root, with a generated slurm.conf in a temporary
folder).  ``epl.init()`` finds the job in the manager's environment and the tasks meet
(epl/core/rendezvous.py); the job must equal the local model on the global batch, and a
killed task must end the job, named.  Skipped, with the reason, where the programs are
missing (CI installs them: .ci/run) or Slurm cannot start here."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.test_multi_worker import _check_workers

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = 120


def _env(**more):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_RENDEZVOUS_TIMEOUT="60")
    for name in list(env):
        if name in ("TF_CONFIG", "EPL_JOB_ID", "EPL_COMM_ADDRESSES", "EPL_RUN_ID",
                    "EPL_JOB_SECRET", "EPL_RENDEZVOUS_DIR") or name.startswith(
                        ("SLURM_", "OMPI_", "PMI_", "PMIX_")):
            del env[name]
    env.update(more)
    return env


def _run(cmd, env, timeout=TIMEOUT):
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail("%s hung:\n%s" % (cmd[0], (e.output or b"").decode()[-5000:]))
    return out.returncode, out.stdout.decode(errors="replace")


# -- Open MPI -----------------------------------------------------------------------------

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]


def _need_mpirun():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install -y openmpi-bin)")


@pytest.mark.parametrize("tasks, devices, transport", [
    (2, 2, "auto"), (4, 1, "auto"), (2, 1, "tcp")])
def test_mpirun_data_parallel_equals_local_model(tmp_path, tasks, devices, transport):
    """``mpirun -np N`` of the program epl-launch runs; "tcp": EPL's collectives through
    the TCP ring that tasks on different nodes use (the addresses and the secret come from
    the rendezvous)."""
    _need_mpirun()
    env = _env(EPL_CLUSTER_DEVICES_PER_WORKER=str(devices))
    if transport == "tcp":
        env["EPL_COMM_TRANSPORT"] = "tcp"
    cmd = MPIRUN[:-1] + [str(tasks), sys.executable, os.path.join(HERE, "mw_train.py"),
                         str(tmp_path)]
    code, out = _run(cmd, env)
    assert code == 0, out[-5000:]
    assert "the job comes from Open MPI: task 1 of %d" % tasks in out, out[-5000:]
    _check_workers(tmp_path, tasks, devices)


def test_mpirun_killed_rank_ends_the_job(tmp_path):
    _need_mpirun()
    start = time.time()
    code, out = _run(MPIRUN + [sys.executable, os.path.join(HERE, "cm_kill.py")],
                     _env(EPL_CLUSTER_DEVICES_PER_WORKER="1"))
    assert code != 0, out[-5000:]
    # Open MPI's own report names the rank, its host and the signal.
    assert "rank 1" in out and "signal 9" in out, out[-5000:]
    assert time.time() - start < 60


# -- Slurm, one node ----------------------------------------------------------------------

def _free_port():
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


SLURM_CONF = """ClusterName=epltest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
NodeName=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _stop(folder, name):
    try:
        with open(os.path.join(folder, name + ".pid")) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _tail(path, n=2000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no %s)" % path


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm cluster (localhost, 2 CPUs) for this module's tests: yields the
    environment whose SLURM_CONF names it; stops its daemons after."""
    missing = [p for p in ("munged", "slurmctld", "slurmd", "srun", "sinfo")
               if shutil.which(p) is None and not os.path.exists("/usr/sbin/" + p)]
    if missing:
        pytest.skip("Slurm is not installed (%s missing; apt-get install -y slurm-wlm munge)"
                    % ", ".join(missing))
    if os.getuid() != 0:
        pytest.skip("the Slurm fixture starts slurmd, which must run as root")
    d = tempfile.mkdtemp(prefix="epl-slurm-", dir="/tmp")   # short: munge's socket path
    os.makedirs(os.path.join(d, "state"))
    os.makedirs(os.path.join(d, "spool"))
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(SLURM_CONF.format(d=d, ctld_port=_free_port(), slurmd_port=_free_port()))
    key = os.path.join(d, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    sbin = lambda p: shutil.which(p) or "/usr/sbin/" + p   # noqa: E731
    env = _env(SLURM_CONF=conf)
    try:
        steps = [[sbin("munged"), "--force", "--key-file=" + key, "--socket=%s/munge.socket" % d,
                  "--pid-file=%s/munged.pid" % d, "--log-file=%s/munged.log" % d,
                  "--seed-file=%s/munged.seed" % d],
                 [sbin("slurmctld"), "-f", conf, "-i"],
                 [sbin("slurmd"), "-f", conf, "-N", "localhost"]]
        for cmd in steps:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, timeout=30)
            if out.returncode != 0:
                pytest.skip("Slurm cannot start here: `%s` exited %d: %s %s"
                            % (" ".join(cmd[:1]), out.returncode, out.stdout.decode()[-500:],
                               _tail(os.path.join(d, os.path.basename(cmd[0]) + ".log"), 500)))
        deadline = time.time() + 30
        while True:
            out = subprocess.run([sbin("sinfo"), "-h", "-o", "%t"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, env=env, timeout=30)
            if out.stdout.decode().strip() == "idle":
                break
            if time.time() > deadline:
                pytest.skip("Slurm cannot start here: the node is not idle after 30 s (%r); "
                            "slurmd.log: %s" % (out.stdout.decode(),
                                                _tail(os.path.join(d, "slurmd.log"), 800)))
            time.sleep(0.3)
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):
            _stop(d, name)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("tasks, devices", [(2, 2), (4, 1)])
def test_srun_data_parallel_equals_local_model(slurm, tmp_path, tasks, devices):
    env = dict(slurm, EPL_CLUSTER_DEVICES_PER_WORKER=str(devices))
    # --overcommit: 4 tasks on the node's 2 CPUs.
    code, out = _run(["srun", "-n", str(tasks), "--overcommit", "--kill-on-bad-exit=1",
                      sys.executable, os.path.join(HERE, "mw_train.py"), str(tmp_path)], env)
    assert code == 0, out[-5000:]
    assert "the job comes from Slurm: task 1 of %d, local rank 1 on localhost" % tasks in out, \
        out[-5000:]
    _check_workers(tmp_path, tasks, devices)


def _sbatch(script, env, folder, prefix, timeout=TIMEOUT):
    """Submit ``script``, wait for its end: (its final state, its output file, the one in
    ``folder`` whose name starts with ``prefix``)."""
    code, out = _run(["sbatch", "--parsable", str(script)], env)
    assert code == 0, out
    job = out.strip().split(";")[0]
    state, deadline = "", time.time() + timeout   # (sbatch --wait polls every 10-30 s)
    while time.time() < deadline:
        code, out = _run(["scontrol", "show", "job", "-o", job], env)
        state = out.split("JobState=")[1].split()[0] if "JobState=" in out else out
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(0.3)
    logs = [p for p in os.listdir(str(folder)) if p.startswith(prefix)]
    assert len(logs) == 1, (state, out, os.listdir(str(folder)))
    return state, (folder / logs[0]).read_text()


def test_sbatch_script(slurm, tmp_path):
    """A batch script as users submit it (its srun step trains), waited for; its output
    file checked and the job equal to the local model."""
    script = tmp_path / "train.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --job-name=epl-test", "#SBATCH --ntasks=2",
        "#SBATCH --output=%s/%%x-%%j.out" % tmp_path,
        "export EPL_CLUSTER_DEVICES_PER_WORKER=2",
        "srun --kill-on-bad-exit=1 %s %s %s" % (sys.executable,
                                               os.path.join(HERE, "mw_train.py"), tmp_path),
        "echo batch done", ""]))
    state, text = _sbatch(script, slurm, tmp_path, "epl-test-")
    assert state == "COMPLETED", text[-5000:]
    assert "worker 0 trained 6 steps" in text and "worker 1 trained 6 steps" in text, text
    assert "batch done" in text and "task 1 of 2" in text, text
    _check_workers(tmp_path, 2, 2)


def test_srun_task_missing_from_the_rendezvous_is_named(slurm, tmp_path):
    """Task 1 never calls epl.init (it sleeps): task 0 names it after
    EPL_RENDEZVOUS_TIMEOUT and the step ends, never hangs."""
    start = time.time()
    inner = ('if [ "$SLURM_PROCID" = 1 ]; then sleep 60; fi; exec %s %s %s'
             % (sys.executable, os.path.join(HERE, "mw_train.py"), tmp_path))
    code, out = _run(["srun", "-n", "2", "--kill-on-bad-exit=1", "bash", "-c", inner],
                     dict(slurm, EPL_RENDEZVOUS_TIMEOUT="3"))
    assert code != 0, out[-5000:]
    assert "rank(s) 1 did not reach the rendezvous" in out, out[-5000:]
    assert "localhost: task 0: Exited with exit code 1" in out, out[-5000:]
    assert time.time() - start < 40, out[-3000:]


def test_two_concurrent_srun_steps_do_not_meet(slurm, tmp_path):
    """Two jobs at once on the one node: each trains its own 2 tasks (keyed rendezvous)."""
    env = dict(slurm, EPL_CLUSTER_DEVICES_PER_WORKER="1")
    procs = []
    for j in (0, 1):
        folder = tmp_path / str(j)
        folder.mkdir()
        procs.append(subprocess.Popen(
            ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable,
             os.path.join(HERE, "mw_train.py"), str(folder)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("concurrent srun steps hung")
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    keys = {line.split("(job ")[1].split(")")[0] for o in outs for line in o.splitlines()
            if "the job comes from Slurm" in line}
    assert len(keys) == 2, outs
    for j in (0, 1):
        _check_workers(tmp_path / str(j), 2, 1)


def test_srun_killed_task_ends_the_job(slurm):
    start = time.time()
    code, out = _run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable,
                      os.path.join(HERE, "cm_kill.py")],
                     dict(slurm, EPL_CLUSTER_DEVICES_PER_WORKER="1"))
    assert code != 0, out[-5000:]
    # srun names the node and the task: "srun: error: localhost: task 1: Killed".
    assert "localhost: task 1: Killed" in out, out[-5000:]
    assert time.time() - start < 60, out[-3000:]


# -- epl-launch --slurm: restarts as new steps --------------------------------------------

def test_epl_launch_slurm_reads_srun_reports_and_builds_the_step():
    """Without Slurm: srun's failure lines (task ranges) in order, the root cause (a task
    srun only stopped is not one), the step's command and the tasks' environment."""
    from epl.launch import cli, slurm as ls
    if shutil.which("srun") is None:
        pytest.skip("srun is not installed (--slurm checks for it)")
    lines = ["srun: error: node02: task 5: Killed", "0: worker 0 step 3",
             "srun: error: node01: tasks 0-1,3: Terminated"]
    failed = ls.failed_tasks(lines)
    assert failed == [(5, "node02", "Killed"), (0, "node01", "Terminated"),
                      (1, "node01", "Terminated"), (3, "node01", "Terminated")]
    assert ls.root_cause(failed) == (5, "node02", "Killed")
    assert ls.root_cause([(1, "a", "Terminated"), (2, "b", "Exited with exit code 1")]) == \
        (2, "b", "Exited with exit code 1")
    script = os.path.join(HERE, "mw_train.py")
    a = cli.parse_args(["--slurm", "--num_workers", "4", "--gpu_per_worker", "2",
                        "--srun_args", "--nodes=2 --gpus-per-task=2", script, "out"])
    cmd = ls.srun_command(a)
    assert cmd[:4] == ["srun", "--kill-on-bad-exit=1", "--label", "--ntasks=4"]
    assert cmd[4:6] == ["--nodes=2", "--gpus-per-task=2"] and cmd[-3:] == [
        sys.executable, script, "out"]
    os.environ["TF_CONFIG"] = "{}"   # (the launcher's own: never passed to a step)
    try:
        env = ls.step_env(a, "s", 2)
    finally:
        del os.environ["TF_CONFIG"]
    assert "TF_CONFIG" not in env
    assert (env["EPL_RESTART_COUNT"], env["EPL_LAUNCH_NUM_WORKERS"],
            env["EPL_CLUSTER_DEVICES_PER_WORKER"], env["EPL_JOB_SECRET"]) == ("2", "4", "2", "s")
    for bad in (["--machine_list", "a:1,b:1"], ["--min_workers", "2", "--max_restarts", "2"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--slurm", "--num_workers", "4"] + bad + [script])
    with pytest.raises(SystemExit):
        cli.parse_args(["--num_workers", "4", "--srun_args", "-N 2", script])


def test_epl_launch_slurm_restarts_a_failed_step(slurm, tmp_path):
    """``epl-launch --slurm --max_restarts 1`` in a batch script as docs/cluster.md shows
    it (sbatch): task 1 kills itself (SIGKILL) after global step 5 of the first step only;
    srun ends the step, the launcher names the task and its host, and starts a new step of
    the same allocation, which resumes from the newest checkpoint.  The final weights (both
    tasks', the last checkpoint's) equal the uninterrupted run's (the local model on the
    global batches)."""
    from tests import restart_train as rt
    from tests.test_restarts import _final_checkpoint, _local, _restored_step
    import numpy as np
    from tests import models
    data = tmp_path / "data"
    data.mkdir()
    x, y = rt.write_files(str(data))
    logs = tmp_path / "logs"
    script = tmp_path / "train.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --job-name=epl-restart", "#SBATCH --ntasks=2",
        "#SBATCH --output=%s/%%x-%%j.out" % tmp_path, "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "%s -m epl.launch --slurm --num_workers 2 --gpu_per_worker 1 --max_restarts 1 "
        "--log_dir %s %s %s %s" % (sys.executable, logs, os.path.join(HERE, "restart_train.py"),
                                   tmp_path, data), ""]))
    state, out = _sbatch(script, dict(slurm, RESTART_KILL="1:5"), tmp_path, "epl-restart-",
                         timeout=2 * TIMEOUT)
    assert state == "COMPLETED", out[-6000:]
    failed = re.search(r"attempt 0 \(slurm-(\d+)\.(\d+)\): task 1 on localhost failed "
                       r"\(srun: Killed\)", out)
    assert failed, out[-6000:]
    job, step = failed.groups()
    assert "restart 1 of 1 (EPL_RESTART_COUNT=1)" in out, out[-6000:]
    # The summary: the failed task and its host, then the allocation's next step, which
    # succeeded.
    summary = out.split("epl-launch summary (Slurm):")[1]
    assert "attempt 0: slurm-%s.%s: task 1 on localhost failed (srun: Killed)" % (job, step) \
        in summary, summary
    assert "attempt 1: slurm-%s.%d: succeeded" % (job, int(step) + 1) in summary, summary
    assert (logs / "worker_1.attempt0.log").exists() and (logs / "worker_1.log").exists()
    start = _restored_step(out, 1)
    assert 1 <= start <= 5, start
    want = _local([rt.global_batch(x, y, 2, s) for s in range(rt.STEPS)])
    for w in range(2):
        models.assert_weights_close(dict(np.load(str(tmp_path / ("worker_%d.npz" % w)))),
                                    want)
    last, weights = _final_checkpoint(tmp_path)
    assert last == rt.STEPS
    models.assert_weights_close(weights, want)


def test_epl_launch_slurm_failure_names_the_task(slurm, tmp_path):
    """Outside an allocation (srun allocates it) and without restarts: task 1 kills itself
    mid-training; the launcher exits 1 within a bound and its summary names the task, its
    host and the end of its log."""
    start = time.time()
    logs = tmp_path / "logs"
    code, out = _run([sys.executable, "-m", "epl.launch", "--slurm", "--num_workers", "2",
                      "--log_dir", str(logs), os.path.join(HERE, "cm_kill.py")], slurm)
    assert code == 1, out[-5000:]
    assert "srun allocates each attempt" in out, out[-5000:]
    message = out.split("epl-launch summary (Slurm):")[1]
    assert re.search(r"attempt 0: slurm-\d+\.0: task 1 on localhost failed \(srun: Killed\)",
                     message), message
    assert "epl-launch: task 1 on localhost failed (srun: Killed)." in message, message
    assert "Last lines of %s:" % (logs / "worker_1.log") in message, message
    assert message.rstrip().endswith("worker 1 step 2"), message   # (its last step)
    assert time.time() - start < 60, out[-3000:]


def test_epl_launch_slurm_timeout_stops_the_step(slurm, tmp_path):
    """--timeout under --slurm: a step that would run for minutes is stopped (never
    restarted, whatever --max_restarts says), the launcher exits 1 within the bound, and
    Slurm has no job of it left."""
    script = tmp_path / "forever.sh"
    script.write_text("echo started; sleep 300\n")
    start = time.time()
    code, out = _run([sys.executable, "-m", "epl.launch", "--slurm", "--num_workers", "2",
                      "--timeout", "4", "--max_restarts", "2", "--log_dir",
                      str(tmp_path / "logs"), str(script)], slurm)
    assert code == 1, out[-3000:]
    assert "[worker 1] started" in out and "restart 1" not in out, out[-3000:]
    assert re.search(r"attempt 0: \S+: still running after --timeout 4s; "
                     r"stopped the step", out), out[-3000:]
    assert time.time() - start < 30, out[-3000:]
    deadline = time.time() + 20
    while True:
        code, queue = _run(["squeue", "-h", "-o", "%i %T"], slurm)
        if not queue.strip() or time.time() > deadline:
            break
        time.sleep(0.3)
    assert not queue.strip(), queue


# -- Slurm, two nodes (network namespaces) ------------------------------------------------

@pytest.mark.parametrize("layout, meeting", [
    ("data_parallel", "folder"), ("pipeline", "folder"), ("data_parallel", "tcp")])
def test_srun_two_nodes_equals_local_model(tmp_path, layout, meeting):
    """Two nodes that are network-namespace hosts (tests/netns.py), one slurmd each, and a
    third running slurmctld and srun.  data_parallel: ``srun -N 2 --ntasks-per-node=2``
    trains across them (EPL's TCP ring between the nodes); pipeline: ``srun -N 2
    --ntasks-per-node=1`` of 2 stages, one per node (TF's runtime between them, the
    chief drives); each equals the local model.  meeting "folder": the tasks meet in
    EPL_RENDEZVOUS_DIR; "tcp": no shared folder is given, so they meet at the TCP meeting
    point of the first node, found by its name (each task sees a hosts file naming the
    nodes, as a cluster's DNS would) at the port of the job step, authenticated by
    EPL_JOB_SECRET."""
    from tests import netns
    for p in ("munged", "slurmctld", "slurmd", "srun"):
        if shutil.which(p) is None and not os.path.exists("/usr/sbin/" + p):
            pytest.skip("Slurm is not installed (%s missing)" % p)
    why = netns.unavailable()
    if why:
        pytest.skip("network namespaces: %s" % why)
    sbin = lambda p: shutil.which(p) or "/usr/sbin/" + p   # noqa: E731
    d = tempfile.mkdtemp(prefix="epl-slurm2-", dir="/tmp")
    net = netns.Network(hosts=3)
    try:
        os.makedirs(os.path.join(d, "state"))
        conf = SLURM_CONF.format(d=d, ctld_port=6817, slurmd_port=6818)
        conf = conf.replace("SlurmctldHost=localhost", "SlurmctldHost=%s(%s)"
                            % (socket.gethostname(), net.address(0)))
        for node in ("h1", "h2"):
            os.makedirs(os.path.join(d, "spool-" + node))
        conf = conf.replace("SlurmdSpoolDir=%s/spool" % d, "SlurmdSpoolDir=%s/spool-%%n" % d)
        conf = conf.replace("SlurmdPidFile=%s/slurmd.pid" % d, "SlurmdPidFile=%s/slurmd-%%n.pid" % d)
        conf = conf.replace("SlurmdLogFile=%s/slurmd.log" % d, "SlurmdLogFile=%s/slurmd-%%n.log" % d)
        conf = conf.replace("NodeName=localhost CPUs=2 State=UNKNOWN",
                            "NodeName=h1 NodeAddr=%s CPUs=2 State=UNKNOWN\n"
                            "NodeName=h2 NodeAddr=%s CPUs=2 State=UNKNOWN"
                            % (net.address(1), net.address(2)))
        conf = conf.replace("Nodes=localhost", "Nodes=h[1-2]")
        path = os.path.join(d, "slurm.conf")
        with open(path, "w") as f:
            f.write(conf)
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        env = _env(SLURM_CONF=path)
        subprocess.run([sbin("munged"), "--force", "--key-file=" + key,
                        "--socket=%s/munge.socket" % d, "--pid-file=%s/munged.pid" % d,
                        "--log-file=%s/munged.log" % d, "--seed-file=%s/munged.seed" % d],
                       check=True, env=env, timeout=30)
        logs = []
        for i, cmd in ((0, [sbin("slurmctld"), "-D", "-i", "-f", path]),
                       (1, [sbin("slurmd"), "-D", "-f", path, "-N", "h1"]),
                       (2, [sbin("slurmd"), "-D", "-f", path, "-N", "h2"])):
            log = open(os.path.join(d, "fg%d.log" % i), "wb")
            logs.append(log)
            # nsenter: the node's network only (`ip netns exec` also remounts /sys, which
            # hides the cgroup file system slurmd wants).
            net.procs.append(subprocess.Popen(
                ["nsenter", "--net=/run/netns/" + net.namespaces[i]] + cmd, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + 40
        while True:
            out = net.run(0, ["env", "SLURM_CONF=" + path, "sinfo", "-h", "-o", "%t %D"])
            if out.stdout.decode().split() == ["idle", "2"]:
                break
            if time.time() > deadline:
                pytest.fail("the two Slurm nodes are not idle: %r\n%s\n%s" % (
                    out.stdout.decode(), _tail(os.path.join(d, "slurmctld.log")),
                    _tail(os.path.join(d, "slurmd-h1.log"))))
            time.sleep(0.3)
        out = tmp_path / "out"
        out.mkdir()
        per_node = 2 if layout == "data_parallel" else 1
        script = "mw_train.py" if layout == "data_parallel" else "mw_pipeline.py"
        if meeting == "folder":
            meet, task = ["EPL_RENDEZVOUS_DIR=%s" % tmp_path], []
        else:
            hosts = tmp_path / "hosts"
            hosts.write_text("127.0.0.1 localhost\n%s h1\n%s h2\n"
                             % (net.address(1), net.address(2)))
            meet = ["EPL_JOB_SECRET=two-nodes-secret"]
            # (a mount namespace of the task's own: the hosts file over /etc/hosts)
            task = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                    str(hosts)]
        cmd = ["env"] + ["%s=%s" % kv for kv in sorted(env.items())] + [
            "EPL_CLUSTER_DEVICES_PER_WORKER=1"] + meet + [
            "srun", "-N", "2", "--ntasks-per-node=%d" % per_node, "--overcommit",
            "--kill-on-bad-exit=1", "--chdir=%s" % out] + task + [
            sys.executable, os.path.join(HERE, script), str(out)]
        res = net.run(0, cmd, timeout=TIMEOUT)
        text = res.stdout.decode(errors="replace")
        assert res.returncode == 0, text[-5000:]
        if meeting == "tcp":
            assert re.search(r"meeting its other tasks over TCP at h1:\d+\.", text), text[-5000:]
            assert "EPL_RENDEZVOUS_DIR" not in " ".join(cmd)
        assert "task %d of %d, local rank %d on h2" % (2 * per_node - 1, 2 * per_node,
                                                       per_node - 1) in text, text[-5000:]
        if layout == "data_parallel":
            _check_workers(out, 4, 1)
        else:
            _check_pipeline(out, text)
    finally:
        net.close()
        _stop(d, "munged")
        shutil.rmtree(d, ignore_errors=True)


def _check_pipeline(out, text):
    """tests/mw_pipeline.py on 2 workers x 1 device: stage 1 ran on worker 1, and the
    chief's weights equal the local model with the micro-batches' gradients summed."""
    import numpy as np
    from tests import models
    from tests import mw_pipeline as mp
    assert "serves its devices" in text and "chief trained" in text, text[-5000:]
    x, y = models.data(mp.STEPS * mp.MICRO * mp.MB)
    want, _ = models.train_local(x, y, mp.MICRO * mp.MB, mp.STEPS, "momentum")
    got = dict(np.load(str(out / "worker_0.npz")))
    assert int(got.pop("steps")) == mp.STEPS
    devices = [str(d) for d in got.pop("devices")]
    assert any("task:1" in d for d in devices), devices
    models.assert_weights_close(got, want)
