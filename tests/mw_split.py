"""A worker of the split-across-workers tests (the seed's MoE tutorial shape:
``epl-launch --num_workers 2 --gpu_per_worker 1`` with ``epl.split(total_gpu_num)``).

``hybrid``: a replicated backbone and a split classifier head; ``moe``: epl.moe_layer
under split; ``moe_recipe_fixed``: the seed's MoE recipe (§5.3.2) on a fixed-shape
dataset.  The chief drives the job in-graph and writes the results; the other
worker serves its device.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import test_split as ts  # noqa: E402


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    n = epl.Env.get().cluster.total_gpu_num
    if mode == "hybrid":
        losses, accs, weights = ts._train(ts._hybrid(ts._head_values(), n, 1), out_dir,
                                          "hybrid", "momentum")
        result = dict(losses=losses, accs=accs, **{"w/" + k: v for k, v in weights.items()})
    elif mode == "moe_recipe_fixed":
        from tests import test_static_shapes as tss
        result = {"w/" + k: v for k, v in tss.seed_moe_recipe(out_dir, n).items()}
    else:
        runs = ts._moe_run(ts._moe_values(4), 4, 2, groups=n, n=n)
        result = dict(losses=np.array([l for l, _ in runs]),
                      outputs=np.stack([o for _, o in runs]))
    devices = sorted(set(op.device for op in tf.get_default_graph().get_operations()
                         if op.type in ("MatMul", "BatchMatMulV2", "Einsum")))
    np.savez(os.path.join(out_dir, "%s.npz" % mode), devices=np.array(devices), **result)
    print("chief finished %s" % mode)


if __name__ == "__main__":
    main()
