"""Pipelines that span workers, split scopes and ZeRO across workers run in-graph on
TensorFlow's distributed runtime.

EPL trains between-graph (every worker drives its own replicas, collectives span
the workers) as long as each model replica fits on one worker.  A pipeline
whose stages are laid out on several workers (more stages than devices per
worker: stage 0 on worker 0, stage 1 on worker 1, ...) needs one driver that
sends activations forward and gradients back every micro-batch; TF's own
runtime does exactly that over gRPC.  ZeRO (``zero.level``) over several workers
needs one copy of each variable and its optimizer state in the whole job, kept
by one device of one worker, that the chief's checkpoints can read and write:
TF's runtime keeps a variable placed on another worker's device in that worker's
memory.  So in those layouts:

* every worker starts a ``tf.train.Server`` from TF_CONFIG (with its virtual
  CPU devices);
* the chief's session runs on its server, and the chief's rewrite places each
  stage on its worker's device (``/job:worker/replica:0/task:1/...``): the
  chief drives every pipeline replica, in-graph;
* the other workers serve their devices: their script stops in its session
  creation and the process exits 0 once the chief's server is gone (the chief
  writes checkpoints and summaries, as always).
"""
import logging
import os
import socket
import sys
import time

from epl import ir, plan
from epl.env import Env

log = logging.getLogger("epl")
_server = [None]


def needed(graph):
    """True when ``graph``'s layout needs one in-graph driver (``plan.in_graph``)."""
    if not Env.initialized():
        return False
    cluster = Env.get().cluster
    if cluster.worker_num <= 1:
        return False
    taskgraphs = ir.Graph.get(graph).taskgraphs
    if not taskgraphs:
        return False
    config = Env.get().config
    layout = plan.plan(cluster, taskgraphs, config)   # pure Python, cheap
    return plan.in_graph(layout, cluster, config)


def server():
    """This worker's ``tf.train.Server`` (started once per process)."""
    if _server[0] is None:
        import tensorflow as tf
        cluster = Env.get().cluster
        spec = {job: list(addrs) for job, addrs in cluster.cluster_spec.items()}
        config = tf.compat.v1.ConfigProto()
        if cluster.device_type == "cpu":
            config.device_count["CPU"] = cluster.cpu_device_count
        _server[0] = tf.compat.v1.train.Server(tf.compat.v1.train.ClusterSpec(spec),
                                               job_name=cluster.task_type,
                                               task_index=cluster.task_index, config=config,
                                               start=True)
        log.info("EPL: started the TF server of %s:%d for an in-graph job",
                 cluster.task_type, cluster.task_index)
    return _server[0]


def serve_until_chief_exits(poll_seconds=0.5):
    """A worker whose devices the chief drives: start serving once the chief's server is
    up (the chief cannot finish without this worker, so this sees it finish), keep
    serving while it answers, then end this process successfully."""
    cluster = Env.get().cluster
    _, _, chief = cluster.workers[0]
    timeout = Env.get().config.get("communication.timeout_seconds")
    deadline = time.time() + timeout
    while not _answers(chief):
        if time.time() > deadline:
            sys.exit("EPL: worker %d waited %ds for the chief (worker 0, %s) to start its TF "
                     "server (communication.timeout_seconds); is it running?"
                     % (cluster.worker_index, timeout, chief))
        time.sleep(poll_seconds)
    server()
    print("EPL: worker %d serves its devices to the chief's in-graph job (%s); it "
          "exits when the chief is done." % (cluster.worker_index, chief), flush=True)
    while _answers(chief):
        time.sleep(poll_seconds)
    print("EPL: the chief is done; worker %d exits." % cluster.worker_index, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


def _answers(address):
    """True when a process accepts a connection at ``address`` and keeps it open.  A relay
    or proxy between the hosts accepts even when the server behind it is gone, then closes
    the connection at once: an end of stream (or a reset) within a moment counts as not
    answering; data (gRPC's settings) or silence counts as answering."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.settimeout(0.5)
            try:
                return conn.recv(1) != b""
            except socket.timeout:
                return True
    except OSError:
        return False
