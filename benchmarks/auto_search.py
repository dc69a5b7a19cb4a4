"""epl.auto.accelerate on 4 virtual devices: is the chosen strategy as fast as the best
hand-picked candidate?

For an MLP and the mini-BERT of the tests: run the search, then measure every
candidate again (each in a fresh process, more steps) and compare the chosen one's
samples/s with the best's (goal: >= 0.9x).  The MLP and a classifier over 20,000
classes (its head is the largest layer: a split candidate) are also searched with a
memory limit below plain data parallelism's peak, so that it is infeasible.

    python benchmarks/auto_search.py [--devices 4] [--steps 10] [--json FILE]
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import print_table, write_json  # noqa: E402

ROWS = 512


def mlp_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 128).astype(np.float32)
    y = rng.randint(0, 10, ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(256, drop_remainder=True)


def mlp_model(features):
    """16 layers of 128 at batch 256: activations outweigh the weights."""
    import tensorflow.compat.v1 as tf
    x, y = features
    h = x
    for i in range(16):
        h = tf.layers.dense(h, 128, activation=tf.nn.relu, name="layer_%d" % i)
    logits = tf.layers.dense(h, 10, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def classifier_model(features):
    """A classifier over 20,000 classes: the head holds most of the weights (the split
    candidate's case)."""
    import tensorflow.compat.v1 as tf
    x, y = features
    h = tf.layers.dense(x, 64, activation=tf.nn.relu, name="hidden")
    logits = tf.layers.dense(h, 20000, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def classifier_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 128).astype(np.float32)
    y = rng.randint(0, 20000, ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)


def bert_dataset():
    import tensorflow.compat.v1 as tf
    from tests.corpus import bert
    return tf.data.Dataset.from_tensor_slices(bert.data(ROWS)).repeat().batch(
        8, drop_remainder=True)


def bert_model(features):
    from tests.corpus import bert
    return bert.model(features)


def adam():
    import tensorflow.compat.v1 as tf
    return tf.train.AdamOptimizer(1e-3)


CASES = {"mlp": (mlp_model, mlp_dataset), "mini_bert": (bert_model, bert_dataset),
         "classifier": (classifier_model, classifier_dataset)}
EXCLUDED = ["amp"]     # CPU float16 kernels are ~400x slower: never a candidate here


def main():
    import logging
    import epl
    from epl.auto import search
    logging.basicConfig(format="%(message)s")
    logging.getLogger("epl").setLevel(logging.INFO)
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    rows, records = [], []
    for name, (model_fn, dataset_fn) in sorted(CASES.items()):
        for limited in (False, True):
            if limited and name == "mini_bert":
                continue
            limit = None
            if limited:   # below plain data parallelism's peak
                dp = search.measure((model_fn, dataset_fn, adam), search.normalize(["data_parallel"]),
                                  args.devices, args.steps, 300)[1]
                limit = int(dp["peak_bytes"] * 0.9)
            ok, result, chosen = epl.auto.accelerate(
                model_fn, dataset_fn, adam, devices=args.devices, excluded=EXCLUDED,
                memory_limit_bytes=limit, dry_run_steps=args.steps)
            if not ok:
                raise SystemExit("epl.auto.accelerate found no feasible strategy for %s" % name)
            again = {}      # feasible candidates, measured again with more steps
            for entry in result.report:
                if entry["status"] != "ok":
                    continue
                status, out = search.measure((model_fn, dataset_fn, adam), entry["strategy"],
                                           args.devices, args.steps, 300)
                if status == "ok":
                    again[json.dumps(entry["strategy"])] = out["samples_per_s"]
            best = max(again, key=again.get)
            ratio = again.get(json.dumps(chosen), 0.0) / again[best]
            rows.append({"model": name, "memory_limit_MiB": limit / 2.0 ** 20 if limit else None,
                         "chosen": "+".join(n for n, _ in chosen),
                         "best_remeasured": "+".join(n for n, _ in json.loads(best)),
                         "chosen/best": ratio, "candidates": len(result.report)})
            records.append({"model": name, "limit": limit, "chosen": chosen,
                            "report": result.report, "remeasured": again, "ratio": ratio})
            epl_reset()
    print_table(rows, ["model", "memory_limit_MiB", "chosen", "best_remeasured", "chosen/best",
                       "candidates"],
                "epl.auto.accelerate on %d virtual devices (goal: chosen/best >= 0.9)"
                % args.devices)
    write_json("auto_search", records, args.json)


def epl_reset():
    import tensorflow.compat.v1 as tf
    tf.reset_default_graph()


if __name__ == "__main__":
    main()
