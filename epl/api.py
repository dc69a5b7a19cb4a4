"""``epl.init``: the entry point that wires EPL into TensorFlow for this process.

It sits at the top of EPL's layers (docs/architecture.md): it checks the config, makes
the cluster, and installs the capture patches, so the modules below it never import
upwards to do so.
"""
import tensorflow as tf

# The features register their backward-pass and apply-path hooks when imported.
from epl.features import accumulate  # noqa: F401
from epl.features import amp
from epl.features import gradient_checkpoint  # noqa: F401
from epl.features import grouped_apply  # noqa: F401
from epl.features import sparse_as_dense  # noqa: F401
from epl.features import auto_stages
from epl.runtime import integration
from epl.ir import strategies
from epl.capture import patches
from epl.core.cluster import Cluster
from epl.core.config import Config
from epl.core.process_state import Env
from epl.core import host_heap
from epl.core import rendezvous
from epl.ir import Graph
from epl.tf_adapter import graph as tfg


def init(config=None):
    """Initialize EPL for this process (seed 001 §3).

    Must run in graph mode (TF1): eager execution has no graph to rewrite.  Called
    again, it starts over as the original EPL does: the new config and cluster, no
    strategy, and a new default graph (the annotations of the old one were laid out
    for the old cluster); build the model after the last ``epl.init``.  Inside a
    ``with graph.as_default():`` block, whose graph cannot be replaced, that graph's
    annotations are dropped instead (refused once it has been rewritten).
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "epl.init(): eager execution is enabled, but EPL rewrites TF1 graphs.  On "
            "TensorFlow 2.x (eager by default) start the program the TF1 way: `import "
            "tensorflow.compat.v1 as tf; tf.disable_v2_behavior()` (or "
            "tf.compat.v1.disable_eager_execution() alone, for resource variables and "
            "control flow v2) before building the model; on TF 1.x remove "
            "tf.enable_eager_execution() / tf.compat.v1.enable_v2_behavior().")
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError("epl.init(config): expected epl.Config, got %r; wrap a dict as "
                        "epl.Config({...})." % type(config).__name__)
    auto_stages.check_config(config)
    if config.get("optimizer.num_apply_group") < 1:
        raise ValueError("epl.Config: 'optimizer.num_apply_group' = %d is invalid; it must be "
                         ">= 1 (1 applies all updates at once)."
                         % config.get("optimizer.num_apply_group"))
    # Under srun / mpirun without TF_CONFIG: meet the job's other tasks, set TF_CONFIG.
    rendezvous.establish(config)
    again = Env.initialized()
    env = Env.install(config, Cluster(config))
    if config.get("cluster.keep_freed_host_memory"):
        host_heap.keep_freed_memory()
    strategies.reset()
    patches.install()
    integration.install()
    if again:
        _start_over()
    return env


def _start_over():
    if tfg.default_graph_replaceable():
        tf.compat.v1.reset_default_graph()
        return
    graph = tf.compat.v1.get_default_graph()
    old = Graph.existing(graph)
    if old is not None and old.rewritten:
        raise RuntimeError(
            "epl.init() called again inside `with graph.as_default():` for a graph EPL "
            "already rewrote for the previous configuration; build the model in a new "
            "tf.Graph after epl.init().")
    Graph.forget(graph)
