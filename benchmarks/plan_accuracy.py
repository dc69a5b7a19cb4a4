"""The planner against runs here (issue 36, local accuracy): for each model and layout,
``epl.auto.predict`` on ``Cluster.local(N)`` vs the layout run by EPL on N virtual CPU
devices, side by side in one run.

Measured (``epl.auto.search.measure``: each case in a process of its own): the median
step time over >= 1 s of steps after a warm-up step, and the fullest device's bytes
during a traced step (the variables it holds + the step's peak there,
``epl.ir.memory_trace``).  Predicted: ``predict`` from the graph (never run) and the
cached calibration of ``Cluster.local`` (measured first if there is none).  The planner's
pick: for each model and device count N, the layout ``predict`` ranks first among the
model's layouts on N devices (as ``plan`` ranks a cluster of N), against the measured
fastest of them (a hit when within 5% of it); a miss is measured again as a pair, the
two layouts alternating (``--side-by-side``, ``side_by_side``), and judged by that run,
both verdicts printed; also over all of a model's layouts.

The machine has 2 cores shared with other users: timings are noisy; a case's step is
the median of its steps, measured ``--rounds`` times round-robin over a model's cases
(case 1, 2, ..., then again), the fastest round kept (``step_s``; all in
``step_s_rounds``; the peak: the largest).  Cases of one model run one after another
(interleaved with nothing else of ours).  The model's kernels are timed anew before each
round and priced at each heavy kernel's fastest round and each light kernel's mean over
the rounds (``fastest_kernels``), where one timing's kernels priced the same
measurements 6-12 % apart round to round.

Models: ``mlp``, ``convnet``, ``gpt`` (``epl.auto.gpt.GPT``), ``widehead`` (an MLP with
an 8192-class head, for the split head), ``resnet`` (a small TF-Slim ResNet v1, a model
written elsewhere: needs ``pip install tf-slim==1.1.0``, skipped with a line without
it).  Layouts beyond DP / PP / memory features: ``... + offload``, ``split head N`` (the
data-parallel backbone with ``search.split_head``'s layer split over N devices, priced
as ``Layout(split_head=True)``; a layout the planner cannot price shows the measurement,
``-`` predicted, status ``unpriced``, left out of the summary), ``TP 2`` and ``TP 2 x DP 2`` (the model's
``epl.split(2)`` variant, ``SPLIT_VARIANTS``, on 2 and 4 devices: 1 and 2 groups, priced
as ``["tensor_parallel", {"degree": 2}]`` of the model built whole, its time and memory
EPL's built step of the variant replayed: ``predict``'s ``split_variants``).  A layout a model
cannot run (no head, no split variant) is skipped with a line.

    python benchmarks/plan_accuracy.py [--quick] [--models mlp,gpt,convnet,widehead,resnet]
        [--layouts "DP 2,PP 4 x m8 gpipe"]  (default: DEFAULT_MODELS x DEFAULT; all: LAYOUTS)
        [--rounds 2] [--steps 5] [--side-by-side 3] [--json benchmarks/results/plan_accuracy.json]
        [--recalibrate] [--reprice old.json]
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROWS = 64


# ----------------------------------------------------------------- models (module level:
# the dry runs import them in processes of their own)
def mlp_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(0)
    x = rng.randn(4 * ROWS, 512).astype(np.float32)
    y = rng.randint(0, 16, 4 * ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ROWS, drop_remainder=True)


def mlp_model(features):
    import tensorflow.compat.v1 as tf
    x, y = features
    h = x
    for i in range(4):
        h = tf.layers.dense(h, 1024, activation=tf.nn.relu, name="layer_%d" % i)
    logits = tf.layers.dense(h, 16, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def mlp_split2_model(features):
    """The MLP with its layers under one ``epl.split(2)``: EPL alternates them column-
    and row-parallel (docs/split.md), the head's 16 classes sharded; no default strategy
    (``gpt_split2_model``)."""
    import epl
    epl.set_default_strategy(None)
    with epl.split(2):
        return mlp_model(features)


def conv_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(1)
    x = rng.randn(2 * 32, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, 2 * 32).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32, drop_remainder=True)


def conv_model(features):
    """The corpus conv net's shape (conv, ReLU, pooling, a dense head) at 32 x 32 x 3."""
    import tensorflow.compat.v1 as tf
    x, y = features
    for i, ch in enumerate((32, 64, 64, 128)):
        with tf.variable_scope("layer_%d" % i):
            x = tf.layers.conv2d(x, ch, 3, padding="same", activation=tf.nn.relu)
            if i % 2 == 1:
                x = tf.layers.max_pooling2d(x, 2, 2)
    x = tf.reduce_mean(x, axis=[1, 2])
    logits = tf.layers.dense(x, 10, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def widehead_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(3)
    x = rng.randn(4 * ROWS, 256).astype(np.float32)
    y = rng.randint(0, WIDE_CLASSES, 4 * ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ROWS, drop_remainder=True)


WIDE_CLASSES = 8192


def widehead_model(features):
    """An MLP whose last Dense (the head, 8192 classes) is its largest: the layer
    ``search.split_head`` finds, for the "split head" layouts."""
    import tensorflow.compat.v1 as tf
    x, y = features
    h = x
    for i in range(2):
        h = tf.layers.dense(h, 512, activation=tf.nn.relu, name="layer_%d" % i)
    logits = tf.layers.dense(h, WIDE_CLASSES, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def resnet_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(2)
    x = rng.randn(2 * 32, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, 2 * 32).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32, drop_remainder=True)


def resnet_model(features):
    """A model written elsewhere: TF-Slim's ResNet v1 (``tf_slim.nets.resnet_v1``, with
    its batch norm arg scope), 3 bottleneck blocks of 2 units at 32 x 32 x 3 (ResNet-50
    is too slow on 2 shared cores)."""
    import tensorflow.compat.v1 as tf
    import tf_slim as slim
    from tf_slim.nets import resnet_v1
    x, y = features
    blocks = [resnet_v1.resnet_v1_block("block1", base_depth=32, num_units=2, stride=2),
              resnet_v1.resnet_v1_block("block2", base_depth=64, num_units=2, stride=2),
              resnet_v1.resnet_v1_block("block3", base_depth=128, num_units=2, stride=1)]
    with slim.arg_scope(resnet_v1.resnet_arg_scope()):
        logits, _ = resnet_v1.resnet_v1(x, blocks, num_classes=10, is_training=True,
                                        global_pool=True, scope="resnet_small")
    logits = tf.squeeze(logits, [1, 2])
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def _gpt(split=None):
    from epl.auto.gpt import GPT
    return GPT(4, 256, 4, seq=128, vocab=2000, batch=8, split=split)


def gpt_dataset():
    return _gpt().dataset_fn()


def gpt_model(features):
    return _gpt().model_fn(features)


def gpt_split2_model(features):
    """The GPT with its embeddings, blocks and head each under ``epl.split(2)``.  No
    default strategy: ``search.build`` sets ``replicate(1)`` as the default (for
    data_parallel) and a ``replicate`` scope beside the split ones would make the
    replicated-backbone hybrid; split scopes alone on d * t devices are d groups."""
    import epl
    epl.set_default_strategy(None)
    return _gpt(split=2).model_fn(features)


def bert_dataset():
    """The test corpus' mini-BERT (tests/corpus/bert.py): ids, types, mask, labels."""
    import tensorflow.compat.v1 as tf
    from tests.corpus import bert
    return tf.data.Dataset.from_tensor_slices(bert.data(4 * ROWS)).repeat().batch(
        ROWS, drop_remainder=True)


def bert_model(features):
    """The corpus' mini-BERT classifier (embeddings, 2 encoder layers, pooler)."""
    from tests.corpus import bert
    return bert.model(features)


def bert_optimizer():
    """The corpus' AdamWeightDecay (its own slots and assign ops)."""
    from tests.corpus import bert
    return bert.AdamWeightDecay(1e-3)


def sgd():
    import tensorflow.compat.v1 as tf
    return tf.train.GradientDescentOptimizer(0.01)


def adam():
    import tensorflow.compat.v1 as tf
    return tf.train.AdamOptimizer(1e-4)


MODELS = {
    "mlp": (mlp_model, mlp_dataset, adam),
    "convnet": (conv_model, conv_dataset, adam),
    "gpt": (gpt_model, gpt_dataset, adam),
    "widehead": (widehead_model, widehead_dataset, adam),
    "resnet": (resnet_model, resnet_dataset, adam),
    "bert": (bert_model, bert_dataset, bert_optimizer),
}
# (model, t): the same model built with its own epl.split(t) scopes, run for a layout
# with ["tensor_parallel", {"degree": t}] (priced from the model above, built whole)
SPLIT_VARIANTS = {
    ("gpt", 2): (gpt_split2_model, gpt_dataset, adam),
    ("mlp", 2): (mlp_split2_model, mlp_dataset, adam),
}
NEEDS = {"resnet": "tf_slim"}      # a model's extra package (pip install tf-slim==1.1.0)


def model_profile(name):
    """The planner's profile of a model, with its epl.split variants (``predict``'s
    ``split_variants``: its TP layouts are EPL's built step of them, replayed)."""
    from epl.auto import graph_profile
    profile = graph_profile.profile(*MODELS[name])
    profile.split_variants = dict((t, fns[0]) for (model, t), fns in SPLIT_VARIANTS.items()
                                  if model == name)
    return profile


def pipe(p, m, schedule):
    return ["pipeline", {"num_stages": p, "num_micro_batch": m, "schedule": schedule}]


# (label, devices, strategy list as accelerate reads it)
LAYOUTS = [
    ("1 device", 1, ["data_parallel"]),
    ("DP 2", 2, ["data_parallel"]),
    ("DP 4", 4, ["data_parallel"]),
    ("PP 2 x m4 1f1b", 2, [pipe(2, 4, "1f1b")]),
    ("PP 2 x m4 gpipe", 2, [pipe(2, 4, "gpipe")]),
    ("PP 2 x m8 1f1b", 2, [pipe(2, 8, "1f1b")]),
    ("PP 2 x m8 gpipe", 2, [pipe(2, 8, "gpipe")]),
    ("PP 4 x m4 1f1b", 4, [pipe(4, 4, "1f1b")]),
    ("PP 4 x m8 1f1b", 4, [pipe(4, 8, "1f1b")]),
    ("PP 4 x m8 gpipe", 4, [pipe(4, 8, "gpipe")]),
    ("DP 2 + GC", 2, ["data_parallel", ["gradient_checkpoint", "auto"]]),
    ("DP 2 + ZeRO", 2, ["data_parallel", ["zero", {"level": "v1"}]]),
    ("DP 2 + AMP bf16", 2, ["data_parallel", ["amp", {"dtype": "bfloat16"}]]),
    ("1 device + offload", 1, ["data_parallel", "offload"]),
    ("DP 2 + offload", 2, ["data_parallel", "offload"]),
    # the data-parallel backbone with the model's head split over every device
    # (search.split_head's layer; models without such a head are skipped)
    ("split head 2", 2, ["split"]),
    ("split head 4", 4, ["split"]),
    # the model's epl.split(2) variant (SPLIT_VARIANTS): 1 group, then 2 groups
    ("TP 2", 2, [["tensor_parallel", {"degree": 2}]]),
    ("TP 2 x DP 2", 4, [["tensor_parallel", {"degree": 2}]]),
]
DEFAULT = ("1 device", "DP 2", "DP 4", "PP 2 x m4 1f1b", "PP 2 x m4 gpipe", "PP 2 x m8 1f1b",
           "PP 4 x m8 1f1b", "DP 2 + GC", "DP 2 + ZeRO", "DP 2 + AMP bf16", "DP 2 + offload",
           "split head 2", "TP 2", "TP 2 x DP 2")
DEFAULT_MODELS = "mlp,gpt,convnet,widehead,resnet,bert"
QUICK = ("1 device", "DP 2", "PP 2 x m4 1f1b")


WAKE_UP = None      # --wake-up: how the replay pays a kernel's wake-up (None: Cluster's)


def local_cluster(calib, devices):
    """``Cluster.local`` from these figures, pricing the model's products by timing
    each on this machine (``epl.auto.product_timing``)."""
    from epl.auto import Cluster
    out = Cluster.from_local(calib, devices)
    out.time_products = True
    out.wake_up = WAKE_UP or out.wake_up
    return out


def predict_case(profile, strategy, devices, rows, cluster):
    from epl.auto.predictor import price
    from epl.auto.search import layout_of
    lay = layout_of(strategy, devices)
    # EPL's replicas and micro-batch clones each pull the dataset's batch (rows): the
    # global batch is rows x micro-batches x replicas (price's default)
    return price(profile, lay, cluster)


def err(pred, got):
    return 100.0 * (pred - got) / got


def _names(strategy):
    return [i if isinstance(i, str) else i[0] for i in strategy]


def tp_degree(strategy):
    """t of the strategy's ["tensor_parallel", {"degree": t}] (1 without one)."""
    for item in strategy:
        if not isinstance(item, str) and item[0] == "tensor_parallel":
            return int((item[1] or {}).get("degree", 1))
    return 1


def missing_package(name):
    """The package a model needs that is not installed (None when none is missing)."""
    import importlib.util
    need = NEEDS.get(name)
    return need if need and importlib.util.find_spec(need) is None else None


def run_case(name, strategy, head):
    """What EPL runs for a layout of a model: (fns, strategy, None), or (None, None, why
    it is skipped).  Tensor parallelism is the model's epl.split variant, run with the
    strategy's other entries (search.normalize refuses a degree > 1: build does not split
    a model); ``split`` needs a head to split (``head``: search.split_head's index)."""
    t = tp_degree(strategy)
    run = [i for i in strategy if isinstance(i, str) or i[0] != "tensor_parallel"]
    if t > 1:
        fns = SPLIT_VARIANTS.get((name, t))
        if fns is None:
            return None, None, "no epl.split(%d) variant of %s (SPLIT_VARIANTS)" % (t, name)
        return fns, run, None
    if "split" in _names(run) and head is None:
        return None, None, "its largest Dense layer is not its last: no head to split"
    return MODELS[name], run, None


def _price(row, profile, cluster):
    """Prices the row (pred_* figures), or marks it unpriced (pred_* None, ``pricing``:
    why) where the planner raises: the split head has no Layout field."""
    try:
        pred = predict_case(profile, row["strategy"], row["devices"], profile.rows, cluster)
    except Exception as e:  # pylint: disable=broad-except
        row.update(pred_step_s=None, pred_peak_bytes=None, pred_samples_per_s=None,
                   pred_global_batch=None, breakdown=None,
                   pricing="%s: %s" % (type(e).__name__, e))
        return
    row.pop("pricing", None)
    row.update(pred_step_s=pred.step_time_s, pred_peak_bytes=pred.peak_memory_bytes,
               pred_samples_per_s=pred.samples_per_s,
               pred_global_batch=pred.breakdown["global_batch"],
               breakdown={k: v for k, v in pred.breakdown.items() if k != "stages"})


def fastest_kernels(best, price_all, round_index, rounds):
    """Times the kernels of the rows anew (a cache folder of this round's, filled by
    ``price_all()``, which prices every row), merges them into ``best`` and points the
    kernel cache at ``best``.  ``round_index``: 0 for the first round, whose kernels were
    timed in the current cache folder as the rows were first priced (``price_all`` is not
    called); ``rounds``: {kernel: its timing in each round so far}, kept by the caller
    across rounds.

    A heavy kernel (``product_timing.HEAVY_S``) keeps each figure's least over the
    rounds, as ``product_timing.measure`` keeps the lesser of its own two timings: other
    work on the shared cores only slows such a run (stop 56: the GPT's kernels timed once
    priced its one-device step 557 ms while its rounds read 401-521).  A light kernel
    keeps each figure's mean over the rounds: what the planner times once is as likely
    fast as slow, and the least of hundreds of microsecond kernels over the rounds
    priced a step of them below every round's own pricing (stop 68: the mini-BERT's
    one-device step 2.87 and 2.77 ms with each round's kernels, 2.52 with their least;
    measured 3.24)."""
    from epl.auto import product_timing
    if round_index:     # (round 1's: timed as its rows were first priced)
        os.environ["EPL_CACHE_DIR"] = tempfile.mkdtemp(
            prefix="epl-plan-round%d-" % (round_index + 1))
        price_all()
    for sig, x in product_timing.cached_timings().items():
        seen = rounds.setdefault(sig, [])
        if x is not None:
            seen.append(x)
        best[sig] = _merged(seen) if seen else None
    from epl.auto import local
    os.environ["EPL_CACHE_DIR"] = tempfile.mkdtemp(prefix="epl-plan-fastest-")
    local.save_cache(best, product_timing.cache_path())


def _merged(timings):
    """One kernel's timings over the rounds as one (``fastest_kernels``): each figure's
    least for a heavy kernel, its mean for a light one."""
    from epl.auto import product_timing
    if any(max(x.get("alone", 0.0), x.get("first", 0.0)) >= product_timing.HEAVY_S
           for x in timings):
        return functools.reduce(product_timing.least, timings)
    out = {}
    for key in set(k for x in timings for k in x):
        values = [x[key] for x in timings if key in x]
        out[key] = sum(values) / float(len(values))
    return out


def record_round(row, status, got, label, r, rounds):
    """One round's measurement into the row (its step, its largest peak) or its failure;
    before the last round, a progress line and False."""
    if status == "ok":
        row["step_s_rounds"].append(got["step_s"])
        row["peak_bytes"] = max(row.get("peak_bytes", 0), got["peak_bytes"])
        row["rows_per_step"] = got["rows_per_step"]
    else:
        row["failures"].append([status, got])
    if r + 1 < rounds:
        print("  (round %d of %d) %s: %s" % (r + 1, rounds, label, "%.2f ms" % (
            1e3 * got["step_s"]) if status == "ok" else status), flush=True)
        return False
    return True


def _rows_per_step(row):
    """The rows a step of the row's layout trains: as priced, else as its run said."""
    return row.get("pred_global_batch") or row["rows_per_step"]


def _settle(row):
    """status and errors of a row from its rounds: ``ok`` (measured and priced),
    ``unpriced`` (measured, not priced) or the measurement's failure."""
    for k in ("time_err", "mem_err", "samples_per_s", "message"):
        row.pop(k, None)
    if row.get("step_s_rounds"):
        row["step_s"] = min(row["step_s_rounds"])      # noise only adds time
        row["samples_per_s"] = _rows_per_step(row) / row["step_s"]
        if row["pred_step_s"] is None:
            row["status"], row["message"] = "unpriced", row["pricing"]
        else:
            row.update(status="ok", time_err=err(row["pred_step_s"], row["step_s"]),
                       mem_err=err(row["pred_peak_bytes"], row["peak_bytes"]))
    else:
        row["status"], row["message"] = row["failures"][-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2-minute subset")
    ap.add_argument("--models", default=None, help="comma-separated, of %s (default %s)"
                    % (",".join(MODELS), DEFAULT_MODELS))
    ap.add_argument("--layouts", default=None, help="labels, comma-separated")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "plan_accuracy.json"))
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every case of a model this many times, round-robin over "
                    "its cases; a case's step: the fastest round's median, its peak: the "
                    "largest; the model's kernels are timed anew in each round and priced "
                    "at a heavy one's fastest and a light one's mean (fastest_kernels)")
    ap.add_argument("--no-calibrate-each-model", dest="calibrate_each_model",
                    action="store_false", help="use the cached calibration throughout "
                    "(default: measure it again before each model, under today's load)")
    ap.add_argument("--reprice", default=None, metavar="JSON",
                    help="price the rows measured in an earlier run's JSON again (the "
                    "predictor changed; the measurements are kept)")
    ap.add_argument("--cached-kernels", action="store_true",
                    help="price with the kernels' timings cached under ~/.cache/epl "
                    "(default: time each model's kernels in this run, under the load "
                    "of its runs, once per round: common.fresh_kernel_timings, "
                    "fastest_kernels)")
    ap.add_argument("--side-by-side", type=int, default=3, metavar="ROUNDS",
                    help="measure each pick that missed again, the plan's first and the "
                    "measured fastest alternating this many rounds each, and judge the "
                    "pick by that pair (0: by the rows alone)")
    from epl.auto import dataflow
    ap.add_argument("--wake-up", choices=dataflow.WAKES, default=None,
                    help="how the replay pays a kernel's wake-up (Cluster.wake_up; "
                    "default: the Cluster's, by the machine's last-level cache: "
                    "machines.wake_up_for): work prices as stops 49-56 did")
    args = ap.parse_args(argv)
    import common
    common.tf1_graph_mode()
    global WAKE_UP
    WAKE_UP = args.wake_up
    if args.reprice:
        return reprice(args.reprice, args.json)
    common.fresh_kernel_timings(args.cached_kernels)
    from epl.auto import Cluster
    from epl.auto import search
    start = time.time()
    names = (args.models or ("mlp" if args.quick else DEFAULT_MODELS)).split(",")
    unknown = [n for n in names if n not in MODELS]
    labels = [label for label, _, _ in LAYOUTS]
    wanted = QUICK if args.quick else DEFAULT
    if args.layouts:
        wanted = args.layouts.split(",")
    unknown += [w for w in wanted if w not in labels]
    if unknown:
        ap.error("unknown %s; the models are %s, the layouts %s" % (
            ", ".join(unknown), ", ".join(MODELS), ", ".join(labels)))
    from epl.auto import local
    calib = Cluster.local(1, recalibrate=args.recalibrate).calibration
    rows_out, pairs = [], {}
    print(HEAD, flush=True)
    for name in names:
        need = missing_package(name)
        if need:
            print("%-8s skipped: the package %s is not installed (pip install tf-slim==1.1.0"
                  ")" % (name, need), flush=True)
            continue
        fns = MODELS[name]
        profile = model_profile(name)
        head = None
        if any(label in wanted and "split" in _names(s) for label, _, s in LAYOUTS):
            head = search.split_head(fns[0], fns[1])    # the layer "split" would split
        if args.calibrate_each_model:     # side by side: the load of the cores now
            calib = local.measure()
        retime = not args.cached_kernels and args.rounds > 1
        if retime:          # this model's kernels, from none
            os.environ["EPL_CACHE_DIR"] = tempfile.mkdtemp(prefix="epl-plan-round1-")
        cases = []
        for label, devices, strategy in LAYOUTS:
            if label not in wanted:
                continue
            run_fns, run, why = run_case(name, strategy, head)
            if why:
                print("%-8s %-20s skipped: %s" % (name, label, why), flush=True)
                continue
            row = dict(model=name, layout=label, devices=devices, strategy=strategy,
                       run_strategy=run, calibration=calib, step_s_rounds=[], failures=[])
            _price(row, profile, local_cluster(calib, devices))
            cases.append((row, run_fns))
        best, kernel_rounds = {}, {}
        for r in range(args.rounds):
            if retime:      # this round's kernels, timed beside its runs (round 1: above)
                fastest_kernels(best, lambda: [
                    _price(row, profile, local_cluster(calib, row["devices"]))
                    for row, _ in cases], r, kernel_rounds)
            for row, run_fns in cases:
                status, got = search.measure(run_fns, row["run_strategy"], row["devices"],
                                             args.steps, 600)
                if not record_round(row, status, got, "%s %s" % (name, row["layout"]), r,
                                    args.rounds):
                    continue
                if retime:  # priced at the rounds' kernels (fastest_kernels)
                    _price(row, profile, local_cluster(calib, row["devices"]))
                row["kernels_folder"] = os.environ.get("EPL_CACHE_DIR")
                _settle(row)
                rows_out.append(row)
                print(_line(row), flush=True)
                if args.json:
                    _write(args.json, calib, rows_out, None)
        if args.side_by_side > 0:
            runs = dict((id(row), run_fns) for row, run_fns in cases)
            pairs.update(side_by_side([row for row, _ in cases], lambda row: search.measure(
                runs[id(row)], row["run_strategy"], row["devices"], args.steps, 600),
                args.side_by_side))
    summary = summarize(rows_out, pairs)
    print()
    print(table(rows_out))
    print()
    for line in summary["lines"]:
        print(line)
    print("(%.0f s; 2 shared cores: timings are noisy, each the fastest of %d rounds' "
          "median steps)" % (time.time() - start, args.rounds))
    if args.json:
        _write(args.json, calib, rows_out, summary)
    return rows_out


def use_run_kernels(row, chosen):
    """Points the kernel cache at the kernels the row's run timed (its
    ``kernels_folder``, while it lasts) unless ``chosen`` (``EPL_CACHE_DIR`` as the
    reprice began) names a cache."""
    folder = row.get("kernels_folder")
    if folder and os.path.isdir(folder) and not chosen:
        os.environ["EPL_CACHE_DIR"] = folder


def reprice(path, out):
    """The rows of an earlier run's JSON priced again: with the kernels that run timed
    (each row's ``kernels_folder``, while it lasts) unless ``EPL_CACHE_DIR`` names a
    cache, else with the cache of ``~/.cache/epl``."""
    chosen = os.environ.get("EPL_CACHE_DIR")
    with open(path) as f:
        old = json.load(f)
    profiles = {}
    for r in old["rows"]:
        if r["model"] not in profiles:
            profiles[r["model"]] = None if missing_package(r["model"]) else \
                model_profile(r["model"])
        prof = profiles[r["model"]]
        use_run_kernels(r, chosen)
        if prof is None:
            print("%-8s %-20s not repriced: %s is not installed" % (
                r["model"], r["layout"], missing_package(r["model"])))
            continue
        _price(r, prof, local_cluster(r.get("calibration", old["calibration"]),
                                           r["devices"]))
        if "step_s" in r:                   # measured (rows of before --rounds too)
            r.setdefault("step_s_rounds", [r["step_s"]])
            r.setdefault("rows_per_step", r.get("pred_global_batch"))
            _settle(r)
    summary = summarize(old["rows"], (old.get("summary") or {}).get("picks_side_by_side"))
    print(table(old["rows"]))
    print()
    for line in summary["lines"]:
        print(line)
    if out:
        _write(out, old["calibration"], old["rows"], summary)
    return old["rows"]


def _write(path, calib, rows, summary):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(calibration=calib, rows=rows, summary={
            k: v for k, v in (summary or {}).items() if k != "lines"}),
            f, indent=1, sort_keys=True, default=str)


HEAD = "%-8s %-20s %9s %9s %7s %9s %9s %7s" % (
    "model", "layout", "pred ms", "meas ms", "err%", "pred MiB", "meas MiB", "err%")


def _f(x, scale, fmt):
    return "-" if x is None else fmt % (x * scale)


def _line(r):
    mib = 1.0 / 2.0 ** 20
    if r["status"] == "ok":
        return "%-8s %-20s %9.2f %9.2f %7.1f %9.1f %9.1f %7.1f" % (
            r["model"], r["layout"], 1e3 * r["pred_step_s"], 1e3 * r["step_s"],
            r["time_err"], r["pred_peak_bytes"] * mib, r["peak_bytes"] * mib, r["mem_err"])
    return "%-8s %-20s %9s %9s %7s %9s %9s %7s  %s: %s" % (
        r["model"], r["layout"], _f(r.get("pred_step_s"), 1e3, "%.2f"),
        _f(r.get("step_s"), 1e3, "%.2f"), "-", _f(r.get("pred_peak_bytes"), mib, "%.1f"),
        _f(r.get("peak_bytes"), mib, "%.1f"), "-", r["status"],
        str(r.get("message", ""))[:70])


def table(rows):
    return "\n".join([HEAD] + [_line(r) for r in rows])


def _simplicity(row):
    """(pipeline stages, split degree, devices) of a row's layout: ``planner.rank``'s
    tie-break as ``plan`` has it ((p, t): its layouts all use the cluster's devices),
    then the fewer devices (the rows here use 1, 2 or 4)."""
    stages = [s[1]["num_stages"] for s in row["strategy"]
              if isinstance(s, list) and s[0] == "pipeline"]
    return (stages[0] if stages else 1, tp_degree(row["strategy"]), row["devices"])


HIT_PCT = 5.0       # a pick within this many % of the measured fastest is a hit


def pick(rows):
    """The planner's pick among ``rows`` (measured and priced): the first as ``plan``
    ranks them on Cluster.local (predicted samples/s; ties within ``LOCAL_TIE``: the
    fewest stages, the lowest split degree, then the fewest devices) against the
    measured fastest, a hit within 5 % of it; and the first by predicted samples/s
    alone."""
    from epl.auto import machines, planner
    fastest = max(rows, key=lambda r: r["samples_per_s"])
    chosen, alone = [planner.rank(rows, lambda r: r["pred_samples_per_s"], _simplicity,
                                  tie)[0] for tie in (machines.LOCAL_TIE, 0.0)]
    gap, gap_alone = [100.0 * (1 - r["samples_per_s"] / fastest["samples_per_s"])
                      for r in (chosen, alone)]
    return dict(predicted_best=chosen["layout"], measured_best=fastest["layout"],
                gap_pct=gap, hit=gap <= HIT_PCT, by_rate_alone=alone["layout"],
                by_rate_alone_gap_pct=gap_alone)


def _picks_of(rows):
    """{"<model> on <N> devices": (its rows, ``pick``)} for each model and N with two or
    more rows measured and priced."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = {}
    for model in sorted(set(r["model"] for r in ok)):
        for n in sorted(set(r["devices"] for r in ok if r["model"] == model)):
            same = [r for r in ok if r["model"] == model and r["devices"] == n]
            if len(same) > 1:
                out["%s on %d devices" % (model, n)] = (same, pick(same))
    return out


def side_by_side(rows, measure, rounds):
    """Each pick that missed (``summarize``: the plan's first more than 5 % slower than
    the measured fastest) measured again as a pair, alternating the two layouts
    ``rounds`` times (A B A B ...), each keeping its fastest; {key: the pair's verdict}.

    The rows' steps are each the fastest of rounds measured minutes apart, and the
    hour's load moves a step by up to 25 % on these shared cores (stop 64: the same
    predictions picked 12 of 12 in one run and 8 of 12 in the next); two layouts
    measured in turn see the same load.  ``measure(row)`` -> (status, figures).  The
    rows' own steps (and so the error table) are left as measured."""
    out = {}
    for key, (same, got) in _picks_of(rows).items():
        if got["hit"]:
            continue
        pair = [next(r for r in same if r["layout"] == got[k])
                for k in ("predicted_best", "measured_best")]
        steps = [[], []]
        for _ in range(rounds):
            for r, mine in zip(pair, steps):
                status, figures = measure(r)
                if status == "ok":
                    mine.append(figures["step_s"])
        if not all(steps):
            continue
        rates = [_rows_per_step(r) / min(mine) for r, mine in zip(pair, steps)]
        gap = 100.0 * (1 - rates[0] / max(rates))
        out[key] = dict(layouts=[r["layout"] for r in pair], step_s_rounds=steps,
                        gap_pct=gap, hit=gap <= HIT_PCT)
        print("  side by side, %d rounds each: %s %s %.2f ms, %s %.2f ms (%.1f%% slower: %s)"
              % (rounds, key, pair[0]["layout"], 1e3 * min(steps[0]), pair[1]["layout"],
                 1e3 * min(steps[1]), gap, "hit" if out[key]["hit"] else "miss"), flush=True)
    return out


def _pick_line(label, got, pair=None):
    return "%-16s plan's first: %-20s measured fastest: %-20s (%.1f%% slower: %s)%s%s" % (
        label, got["predicted_best"], got["measured_best"], got["gap_pct"],
        "hit" if got["hit"] else "miss",
        "" if got["by_rate_alone"] == got["predicted_best"] else
        "; by samples/s alone: %s (%.1f%%)" % (got["by_rate_alone"],
                                                got["by_rate_alone_gap_pct"]),
        "" if pair is None else "; side by side, %d rounds each: %.1f%% slower: %s" % (
            len(pair["step_s_rounds"][0]), pair["gap_pct"], "hit" if pair["hit"] else "miss"))


def summarize(rows, pairs=None):
    """Errors and picks over the rows measured and priced (``ok``; unpriced rows and
    failures are left out).  The picks the target reads (``picks``) are ``plan``'s
    question: for a model on a cluster of N devices, which of the layouts on N devices
    is fastest (``plan`` ranks only layouts that use the cluster's devices), one pick
    per model and N with two or more rows; a miss that ``side_by_side`` measured again
    (``pairs``) is judged by that pair's run, both printed.  ``picks_across_sizes``
    ranks all of a model's rows together (1, 2 and 4 devices; a question ``plan`` does
    not answer: the rows' samples/s on different clusters), as stops 45-57 reported
    it."""
    pairs = pairs or {}
    ok = [r for r in rows if r["status"] == "ok"]
    out = {"lines": []}
    if not ok:
        return out
    te = sorted(abs(r["time_err"]) for r in ok)
    me = sorted(abs(r["mem_err"]) for r in ok)
    under = [r for r in ok if r["mem_err"] < -10]
    out.update(time_median_abs=float(np.median(te)), time_worst_abs=te[-1],
               memory_median_abs=float(np.median(me)), memory_worst_abs=me[-1],
               memory_under_10=[(r["model"], r["layout"], r["mem_err"]) for r in under])
    out["lines"].append("step time: median |error| %.1f%%, worst %.1f%% (targets 10%%, 25%%)"
                        % (out["time_median_abs"], out["time_worst_abs"]))
    out["lines"].append("memory:    median |error| %.1f%%, worst %.1f%%; under-predicted by "
                        "> 10%%: %d of %d" % (out["memory_median_abs"],
                                               out["memory_worst_abs"], len(under), len(ok)))
    picks = dict((key, got) for key, (_, got) in _picks_of(ok).items())
    across = dict((model, pick([r for r in ok if r["model"] == model]))
                  for model in sorted(set(r["model"] for r in ok)))
    verdicts = [pairs[key]["hit"] if key in pairs else got["hit"]
                for key, got in picks.items()]
    out["lines"].append("picks (plan on a cluster of N devices, its layouts on N): %d of %d%s"
                        % (sum(verdicts), len(picks), "" if not pairs else
                           " (%d of them judged side by side; by the rows alone: %d)"
                           % (len(pairs), sum(got["hit"] for got in picks.values()))))
    out["lines"].extend(_pick_line(key, got, pairs.get(key))
                        for key, got in sorted(picks.items()))
    out["lines"].append("across cluster sizes (all of a model's rows ranked together):")
    out["lines"].extend(_pick_line(key, got) for key, got in sorted(across.items()))
    out["picks_across_sizes"] = across
    out["picks"] = picks
    out["picks_side_by_side"] = pairs
    out["picks_hit"] = sum(verdicts)
    unpriced = [r for r in rows if r["status"] == "unpriced"]
    if unpriced:
        out["lines"].append("measured, not priced (left out above): %s" % ", ".join(
            "%s %s" % (r["model"], r["layout"]) for r in unpriced))
    return out


if __name__ == "__main__":
    main()
