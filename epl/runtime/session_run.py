"""Session integration: EPL's devices in every session, when to rewrite, merged fetches.

The graph is rewritten before its first run (or callable: tf.keras trains
through ``Session._make_callable_from_options``) or when it is finalized
(MonitoredTrainingSession, Estimator).  Ops built after that (a train op built
after initializing the variables, tf.keras's train function, a new input
pipeline) are rewritten before the next run that follows them.
"""
import tensorflow as tf

from epl import ir
from epl.core.process_state import Env
from epl.core.worker_files import mark_joined
from epl.rewrite import rewrite_if_needed


def session_config(config):
    """The user's ConfigProto plus what EPL's devices need."""
    if not Env.initialized():
        return config
    cluster = Env.get().cluster
    merged = tf.compat.v1.ConfigProto()
    if config is not None:
        merged.CopyFrom(config)
    if cluster.device_type == "cpu":
        have = merged.device_count.get("CPU", 1)
        merged.device_count["CPU"] = max(have, cluster.cpu_device_count)
    elif cluster.run_visible_devices:
        merged.gpu_options.visible_device_list = cluster.run_visible_devices
    return merged


def map_fetches(graph, fetches):
    """Replace fetched tensors that have a merged counterpart (epl.GraphKeys)."""
    result = ir.Graph.get(graph).rewrite_result
    if result is None or not result.merged:
        return fetches
    return _map(fetches, result.merged)


def _map(fetch, merged):
    if isinstance(fetch, tf.Tensor):
        return merged.get(fetch.name, fetch)
    if isinstance(fetch, str):
        return merged[fetch].name if fetch in merged else fetch
    if isinstance(fetch, dict):
        return type(fetch)((k, _map(v, merged)) for k, v in fetch.items())
    if isinstance(fetch, tuple) and hasattr(fetch, "_fields"):
        return type(fetch)(*[_map(v, merged) for v in fetch])
    if isinstance(fetch, (list, tuple)):
        return type(fetch)(_map(v, merged) for v in fetch)
    return fetch


def before_run(session):
    """Rewrite ``session``'s graph if ops were built since the last rewrite.  The first
    run of a rewritten graph in a multi-worker job is where this worker joins the job's
    collectives: epl-launch is told (a worker that exits 0 before that, while its peers
    wait for it, ends the job at once)."""
    result = rewrite_if_needed(session.graph)
    if result is not None and ir.Graph.get(session.graph).taskgraphs:
        if Env.get().cluster.worker_num > 1:
            mark_joined()


def map_callable(graph, callable_options):
    """``callable_options`` with fetches of merged tensors (epl.GraphKeys) replaced."""
    result = ir.Graph.get(graph).rewrite_result
    if result is None or not result.merged:
        return callable_options
    out = type(callable_options)()
    out.CopyFrom(callable_options)
    for i, name in enumerate(out.fetch):
        if name in result.merged:
            out.fetch[i] = result.merged[name].name
    return out
