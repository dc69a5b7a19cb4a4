"""Process-wide EPL state: the config and the cluster, set by ``epl.init``."""
from epl.config import Config


class Env(object):
    """``Env.get()`` returns the state made by the last ``epl.init``.  Before
    ``epl.init`` it returns an Env with the default config and no cluster (as the
    original EPL does); ``Env.initialized()`` tells the two apart."""
    _instance = None

    def __init__(self, config, cluster):
        self.config = config
        self.cluster = cluster

    @classmethod
    def get(cls):
        if cls._instance is None:
            return Env(Config(), None)
        return cls._instance

    @classmethod
    def initialized(cls):
        return cls._instance is not None


def init(config=None):
    """Initialize EPL for this process (seed 001 §3).

    Must run in graph mode (TF1): eager execution has no graph to rewrite.  Called
    again, it starts over as the original EPL does: the new config and cluster, no
    strategy, and a new default graph (the annotations of the old one were laid out
    for the old cluster); build the model after the last ``epl.init``.  Inside a
    ``with graph.as_default():`` block, whose graph cannot be replaced, that graph's
    annotations are dropped instead (refused once it has been rewritten).
    """
    import tensorflow as tf
    from epl import strategies, tf_patches
    from epl.cluster import Cluster
    if tf.executing_eagerly():
        raise RuntimeError("epl.init(): eager execution is enabled, but EPL rewrites TF1 graphs. "
                           "Remove tf.enable_eager_execution() / tf.compat.v1.enable_v2_behavior(), "
                           "or call tf.compat.v1.disable_eager_execution() first.")
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError("epl.init(config): expected epl.Config, got %r; wrap a dict as "
                        "epl.Config({...})." % type(config).__name__)
    from epl import auto_stages
    auto_stages.check_config(config)
    if config.get("optimizer.num_apply_group") < 1:
        raise ValueError("epl.Config: 'optimizer.num_apply_group' = %d is invalid; it must be "
                         ">= 1 (1 applies all updates at once)."
                         % config.get("optimizer.num_apply_group"))
    again = Env._instance is not None
    Env._instance = Env(config, Cluster(config))
    strategies.reset()
    tf_patches.install()
    if again:
        _start_over()
    return Env._instance


def _start_over():
    import tensorflow as tf
    from tensorflow.python.framework import ops
    if ops._default_graph_stack.is_cleared():  # pylint: disable=protected-access
        tf.compat.v1.reset_default_graph()
        return
    graph = tf.compat.v1.get_default_graph()
    old = getattr(graph, "_epl_graph", None)
    if old is not None and old.rewritten:
        raise RuntimeError(
            "epl.init() called again inside `with graph.as_default():` for a graph EPL "
            "already rewrote for the previous configuration; build the model in a new "
            "tf.Graph after epl.init().")
    if old is not None:
        del graph._epl_graph
