"""The cluster EPL trains on: workers from TF_CONFIG and the devices of each.

Devices are the visible GPUs, or ``cluster.devices_per_worker`` virtual CPU
devices per worker (each standing in for a GPU), so every strategy runs on a
laptop.  This module only describes the cluster; it builds no graph.
"""
import json
import os

from epl.core import worker_files
from epl.tf_adapter import devices as tf_devices

WORKER_JOBS = ("chief", "worker")


class Cluster(object):
    """Workers (chief first, then workers) and the devices EPL trains on.

    Attributes follow the seeds: ``worker_num``, ``worker_index``,
    ``gpu_num_per_worker``, ``total_gpu_num`` (counting whatever device type
    EPL trains on).
    """

    def __init__(self, config, tf_config=None, visible_gpus=None):
        tf_config = _read_tf_config() if tf_config is None else tf_config
        self.cluster_spec = tf_config.get("cluster", {}) or {}
        task = tf_config.get("task", {}) or {}
        self.task_type = task.get("type", "worker" if not self.cluster_spec else None)
        self.task_index = int(task.get("index", 0))
        if self.cluster_spec and self.task_type is None:
            raise ValueError("TF_CONFIG has a 'cluster' but no 'task': set "
                             "{'task': {'type': 'worker', 'index': i}}.")
        # The training workers in a fixed order: chief (if any) is worker 0.
        self.workers = []
        for job in WORKER_JOBS:
            for i, addr in enumerate(self.cluster_spec.get(job, [])):
                self.workers.append((job, i, addr))
        self.ps_hosts = list(self.cluster_spec.get("ps", []))
        if not self.workers:
            self.workers = [("worker", 0, None)]
        self.worker_num = len(self.workers)
        if self.task_type in WORKER_JOBS:
            self.worker_index = [(j, i) for j, i, _ in self.workers].index(
                (self.task_type, self.task_index))
        else:
            self.worker_index = -1  # a ps task trains nothing
        self.is_chief = self.worker_index == 0
        self.distributed = bool(self.cluster_spec)

        self.device_type = _device_type(config, visible_gpus)
        self.run_visible_devices = config.get("cluster.run_visible_devices")
        per_worker = config.get("cluster.devices_per_worker")
        if per_worker < 0:
            raise ValueError("epl.Config: 'cluster.devices_per_worker' = %d is invalid; "
                             "use 0 (all visible) or a positive count." % per_worker)
        if self.device_type == "gpu":
            gpus = _visible_gpu_ids(self.run_visible_devices, visible_gpus)
            if per_worker > len(gpus):
                raise ValueError("epl.Config: 'cluster.devices_per_worker' = %d but only %d "
                                 "GPUs are visible (%s)." % (per_worker, len(gpus), gpus))
            self.gpu_num_per_worker = per_worker or len(gpus)
        else:
            self.gpu_num_per_worker = per_worker or 1
        self.total_gpu_num = self.gpu_num_per_worker * self.worker_num
        # offload.level = v0: variables live in host memory.  On CPU the host is one
        # more virtual device after the training devices, so device and host bytes
        # stay apart as they are on GPUs.
        self.offload = bool(config.get("offload.level"))
        self.cpu_device_count = self.gpu_num_per_worker + (
            1 if self.offload and self.device_type == "cpu" else 0)

    def job_of(self, worker):
        job, index, _ = self.workers[worker]
        return "/job:%s/replica:0/task:%d" % (job, index) if self.distributed \
            else "/job:localhost/replica:0/task:0"

    def device(self, global_index):
        """Device string of the ``global_index``-th training device."""
        worker, local = divmod(global_index, self.gpu_num_per_worker)
        kind = "GPU" if self.device_type == "gpu" else "CPU"
        return "%s/device:%s:%d" % (self.job_of(worker), kind, local)

    def host_device(self, worker=None):
        """The host memory of ``worker`` (offloaded variables): its CPU, or on a CPU
        cluster the virtual device after its training devices.  ``worker`` None: this
        worker as its own session names it."""
        index = self.gpu_num_per_worker if self.device_type == "cpu" else 0
        job = self.job_of(worker) if worker is not None else "/job:localhost/replica:0/task:0"
        return "%s/device:CPU:%d" % (job, index)

    def local_device(self, local_index):
        """A device of this worker as its own (local) session names it."""
        kind = "GPU" if self.device_type == "gpu" else "CPU"
        return "/job:localhost/replica:0/task:0/device:%s:%d" % (kind, local_index)

    @property
    def job_id(self):
        """Identifies this job's collectives on the host: EPL_JOB_ID, else a hash of the cluster."""
        import hashlib
        explicit = os.environ.get(worker_files.JOB_ID_ENV)
        if explicit:
            return explicit
        return hashlib.sha1(json.dumps(self.cluster_spec, sort_keys=True).encode()).hexdigest()[:12]

    def cross_worker_transport(self):
        """How this job's workers exchange data: "shm" when every worker is on this
        machine, else "tcp" (EPL_COMM_TRANSPORT overrides)."""
        forced = os.environ.get("EPL_COMM_TRANSPORT")
        if forced:
            if forced not in ("shm", "tcp"):
                raise ValueError("EPL_COMM_TRANSPORT=%r: use 'shm' or 'tcp'." % forced)
            return forced
        if self.all_hosts_local():
            return "shm"
        if not os.environ.get(worker_files.COMM_ADDRESSES_ENV):
            raise RuntimeError(
                "the workers in TF_CONFIG are on several hosts: EPL's TCP transport needs "
                "EPL_COMM_ADDRESSES (host:port per worker, in worker order; epl-launch sets "
                "it) on every worker.")
        return "tcp"

    def all_hosts_local(self):
        """True when every worker's address is an address of this machine (shm reaches it)."""
        import socket
        for _, _, addr in self.workers:
            if addr is None:
                continue
            host = addr.rsplit(":", 1)[0]
            try:
                s = socket.socket()
                s.bind((host, 0))
                s.close()
            except OSError:
                return False
        return True

    @property
    def devices(self):
        return [self.device(i) for i in range(self.total_gpu_num)]

    @property
    def local_devices(self):
        base = max(self.worker_index, 0) * self.gpu_num_per_worker
        return [self.device(base + i) for i in range(self.gpu_num_per_worker)]

    def __repr__(self):
        return ("Cluster(worker_num=%d, worker_index=%d, device_type=%r, "
                "gpu_num_per_worker=%d, total_gpu_num=%d)"
                % (self.worker_num, self.worker_index, self.device_type,
                   self.gpu_num_per_worker, self.total_gpu_num))


def _read_tf_config():
    raw = os.environ.get("TF_CONFIG", "")
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ValueError("TF_CONFIG is not valid JSON (%s): %r" % (e, raw[:200]))


def _visible_gpu_ids(run_visible_devices, visible_gpus):
    gpus = list(range(_count_gpus())) if visible_gpus is None else list(range(visible_gpus))
    if run_visible_devices:
        wanted = [int(x) for x in run_visible_devices.split(",") if x.strip()]
        gpus = [g for g in wanted if g in gpus]
    return gpus


def _count_gpus():
    """Number of GPUs TensorFlow can see, without creating a session."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    try:
        if not _tf_built_with_cuda():
            return 0
        return tf_devices.local_gpu_count()
    except Exception:  # pragma: no cover - no TF, broken driver
        return 0


def _tf_built_with_cuda():
    import tensorflow as tf
    return tf.test.is_built_with_cuda()


def _device_type(config, visible_gpus):
    want = config.get("cluster.device_type")
    if want == "cpu":
        return "cpu"
    n = _count_gpus() if visible_gpus is None else visible_gpus
    if want == "gpu" and n == 0:
        raise ValueError("epl.Config: 'cluster.device_type' = 'gpu' but no GPU is visible; "
                         "use 'auto' or 'cpu' (virtual CPU devices).")
    return "gpu" if n > 0 else "cpu"
