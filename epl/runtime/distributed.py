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
  writes checkpoints and summaries, as always), or exits 1 with a
  ``ChiefUnreachableError`` when the chief has not answered for
  communication.timeout_seconds (``serve_until_chief_exits``).
"""
import logging
import os
import socket
import sys
import time
import traceback

from epl import ir
from epl.core import layout
from epl.core.process_state import Env

log = logging.getLogger("epl")
_server = [None]


def needed(graph):
    """True when ``graph``'s layout needs one in-graph driver (``layout.in_graph``)."""
    if not Env.initialized():
        return False
    cluster = Env.get().cluster
    if cluster.worker_num <= 1:
        return False
    taskgraphs = ir.Graph.get(graph).taskgraphs
    if not taskgraphs:
        return False
    config = Env.get().config
    plan = layout.plan(cluster, taskgraphs, config)   # pure Python, cheap
    return layout.in_graph(plan, cluster, config)


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


class ChiefUnreachableError(RuntimeError):
    """The chief of an in-graph job did not answer a serving worker for
    communication.timeout_seconds."""


# What a probe of the chief's server finds.
ANSWERS, GONE, UNREACHABLE = "answers", "gone", "unreachable"
# Consecutive probes that find the chief's port closed before it counts as done.
GONE_PROBES = 3
PROBE_TIMEOUT = 5


def serve_until_chief_exits(poll_seconds=0.5):
    """A worker whose devices the chief drives: start serving once the chief's server is
    up (the chief cannot finish without this worker, so this sees it finish), keep
    serving while it answers, then end this process successfully.

    One failed probe proves little: a loaded chief, or a network that drops packets for
    a moment, lets a connection attempt time out.  So only a chief whose port is closed
    (refused, or closed at once by a relay) in ``GONE_PROBES`` probes in a row is done
    (its process ended: a TF server's port is freed only then): this worker exits 0.  A
    chief that answers no probe for communication.timeout_seconds, its probes timing
    out, is unreachable: this worker exits 1 with a ``ChiefUnreachableError`` line that
    epl-launch reports as the cause (it used to exit 0 after one failed probe, and the
    launcher then blamed it for leaving before it joined)."""
    cluster = Env.get().cluster
    _, _, chief = cluster.workers[0]
    timeout = Env.get().config.get("communication.timeout_seconds")
    deadline = time.time() + timeout
    while _probe(chief) != ANSWERS:
        if time.time() > deadline:
            raise ChiefUnreachableError(
                "EPL: worker %d waited %d s for the chief (worker 0, %s) to start its TF "
                "server (communication.timeout_seconds); is it running?"
                % (cluster.worker_index, timeout, chief))
        time.sleep(poll_seconds)
    server()
    print("EPL: worker %d serves its devices to the chief's in-graph job (%s); it "
          "exits when the chief is done." % (cluster.worker_index, chief), flush=True)
    silent_since, gone = None, 0
    while True:
        state = _probe(chief)
        if state == ANSWERS:
            silent_since, gone = None, 0
        else:
            gone = gone + 1 if state == GONE else 0
            if gone >= GONE_PROBES:
                break
            silent_since = silent_since or time.time()
            if time.time() - silent_since >= timeout:
                _exit_unreachable(
                    "EPL: worker %d serves its devices to the chief's in-graph job, but the "
                    "chief (worker 0, %s) has been unreachable for %d s "
                    "(communication.timeout_seconds; last probe: %s): it hangs, or its host "
                    "is cut off from this one; worker %d stops"
                    % (cluster.worker_index, chief, timeout,
                       "connection closed" if state == GONE else
                       "no connection within %d s" % PROBE_TIMEOUT, cluster.worker_index))
        time.sleep(poll_seconds)
    print("EPL: the chief is done; worker %d exits." % cluster.worker_index, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


def _exit_unreachable(message):
    """End this serving worker with status 1, its last line the error as Python prints
    an uncaught one (what epl-launch's triage looks for).  os._exit, as on success: the
    TF server cannot be stopped, and the script must not go on past its session."""
    error = ChiefUnreachableError(message)
    sys.stdout.flush()
    sys.stderr.write("".join(traceback.format_exception_only(type(error), error)))
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access


def _probe(address):
    """ANSWERS when a process accepts a connection at ``address`` and keeps it open;
    GONE when the connection is refused, or closed within a moment (a relay or proxy
    between the hosts accepts even when the server behind it is gone, then closes the
    connection at once); UNREACHABLE when no connection is made within
    ``PROBE_TIMEOUT`` seconds (or the network says there is no route).  Data (gRPC's
    settings) or silence after connecting counts as answering."""
    host, port = address.rsplit(":", 1)
    try:
        conn = socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT)
    except ConnectionRefusedError:
        return GONE
    except OSError:
        return UNREACHABLE
    with conn:
        conn.settimeout(0.5)
        try:
            return ANSWERS if conn.recv(1) != b"" else GONE
        except socket.timeout:
            return ANSWERS
        except ConnectionResetError:
            return GONE
        except OSError:
            return UNREACHABLE


def _answers(address):
    """True when the chief's server at ``address`` answers a probe (``_probe``)."""
    return _probe(address) == ANSWERS
