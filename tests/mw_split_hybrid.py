"""A worker of the 2-worker transformer hybrid test (tests/test_split_hybrids.py): the
GPT decoder's embeddings and LM head under replicate(1), its blocks under split(2), on
2 workers x 2 devices.  The chief drives the job in-graph and writes the results; the
other worker serves its devices."""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import test_split_hybrids as sh  # noqa: E402
from tests import transformer_models as tm  # noqa: E402


def main():
    out_dir = sys.argv[1]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({}))
    losses, weights, graph = sh._train(tm.Decoder(scope=sh._replicated_ends), out_dir,
                                       "hybrid")
    heads = sorted(sh._devices(graph, "block_0/", ["BatchMatMulV2", "BatchMatMul"]))
    head = sorted(sh._devices(graph, "lm_head/", ["MatMul"]))
    np.savez(os.path.join(out_dir, "hybrid.npz"), losses=losses, heads=np.array(heads),
             head=np.array(head), **{"w/" + k: v for k, v in weights.items()})
    print("chief finished hybrid")


if __name__ == "__main__":
    main()
