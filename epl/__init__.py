"""EPL: turn a single-device TensorFlow 1.x training script into a distributed one.

    import epl
    epl.init()
    epl.set_default_strategy(epl.replicate(device_count=1))
    ... the unchanged TF1 model and session ...
"""
from epl import auto
from epl.api import init
from epl.ir.graph_keys import GraphKeys, add_to_collection, get_all_collections, get_collection
from epl.core.config import Config
from epl.core.process_state import Env
from epl.ir import Graph
from epl.ir.strategies import replicate, set_default_strategy, split
from epl.tensor_parallel.moe import moe_layer

VERSION = "0.1.0"
__version__ = VERSION

__all__ = ["Config", "Env", "Graph", "GraphKeys", "VERSION", "add_to_collection", "auto",
           "get_all_collections", "get_collection", "init", "moe_layer", "replicate",
           "set_default_strategy", "split"]
