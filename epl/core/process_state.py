"""Process-wide EPL state: the config and the cluster, set by ``epl.init``."""
from epl.core.config import Config


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

    @classmethod
    def install(cls, config, cluster):
        """Make (config, cluster) the process's state (``epl.init``); returns it."""
        cls._instance = Env(config, cluster)
        return cls._instance
