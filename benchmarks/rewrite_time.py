"""What a user waits for before the first training step of a BERT-base-sized graph
(12 layers, hidden 768, Adam) under EPL, data parallel on D virtual CPU devices with M
micro-batches (D x M clones) -- measured cold.

Every measurement is its own fresh process (``--repeat`` processes per configuration),
and in it the rewrite is the process's first: no figure comes from a process that has
rewritten (or run) a graph before.  Table, one row per process:

* build_s: the user's own Python building the one-replica graph (model + minimize);
* rewrite_s: EPL's rewrite of it (cold), and rewrite_vs_build, its ratio to build_s;
* init_run_s, first_step_s: TensorFlow's first runs of the rewritten graph (the
  initializer, then the first training step: the session takes in the large graph,
  prunes it and builds its executors), tf_first_run_s their sum;
* wait_s: build + rewrite + TensorFlow's first runs, what the user waits for;
* with ``--second-step``, second_step_s: the step's own math (no first-run setup);
* ops before / after the rewrite, and the floor: one ``tf.import_graph_def`` of the
  user's graph per clone into a fresh graph (in a fresh process of its own, once per
  configuration), vs_floor = rewrite_s / import_floor_s.
``--towers`` also counts the ops of hand-written tower replication of the same clones
(the classic TF1 pattern: one copy of forward and backward per clone, gradients
averaged with add_n, one Adam update).  ``--tiny`` runs the corpus's mini-BERT instead
(a quick check of the benchmark itself).

``--baseline DIR`` also measures the EPL of another source tree (e.g. a ``git archive``
of an older commit, with its C++ library built into its ``epl/lib``): the same script
and model, its ``epl`` first on the path; the two trees' processes alternate, and a last
table puts each configuration's median figures side by side (``tree``: this / baseline).

    python benchmarks/rewrite_time.py [--configs 2x1,8x1,2x4,8x4] [--repeat 2] [--no-step]
                                      [--second-step] [--towers] [--tiny] [--json FILE]
                                      [--baseline DIR]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "corpus"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import print_table, write_json  # noqa: E402
import watchdog  # noqa: E402

SEQ, ROWS = 16, 2     # small batches: the first step's time is the graph's, not the math's


def _bert(tiny):
    import bert
    if not tiny:
        bert.VOCAB, bert.SEQ, bert.HIDDEN, bert.HEADS = 30522, SEQ, 768, 12
        bert.LAYERS, bert.FFN, bert.CLASSES = 12, 3072, 2
    return bert


def _features(bert, rows):
    import tensorflow.compat.v1 as tf
    ids, types, mask, labels = bert.data(rows * 4)
    ds = tf.data.Dataset.from_tensor_slices((ids, types, mask, labels)).repeat()
    ds = ds.batch(rows, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


def _optimizer():
    import tensorflow.compat.v1 as tf
    return tf.train.AdamOptimizer(1e-4)


def child(devices, micro, run_step, tiny):
    """One cold measurement: this process builds, rewrites and runs the graph once."""
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    import epl
    from epl.rewrite import rewrite_if_needed
    bert = _bert(tiny)
    out = {"config": "%dx%d" % (devices, micro), "clones": devices * micro, "pid": os.getpid(),
           "epl": os.path.dirname(os.path.dirname(os.path.abspath(epl.__file__)))}

    with tf.Graph().as_default() as g:
        t0 = time.perf_counter()
        epl.init(epl.Config({"cluster.devices_per_worker": devices,
                             "pipeline.num_micro_batch": micro}))
        epl.set_default_strategy(epl.replicate(1))
        loss = bert.model(_features(bert, ROWS * micro))
        step = tf.train.get_or_create_global_step()
        train = _optimizer().minimize(loss, global_step=step)
        out["build_s"] = time.perf_counter() - t0
        out["ops_before"] = len(g.get_operations())
        cfg = tf.ConfigProto(device_count={"CPU": devices})
        with tf.Session(config=cfg) as sess:
            # What the first sess.run does first (timed apart from TensorFlow's part).
            t0 = time.perf_counter()
            rewrite_if_needed(g)
            out["rewrite_s"] = time.perf_counter() - t0
            out["ops_after"] = len(g.get_operations())
            out["rewrite_vs_build"] = out["rewrite_s"] / out["build_s"]
            init = tf.global_variables_initializer()
            t0 = time.perf_counter()
            sess.run(init)
            out["init_run_s"] = time.perf_counter() - t0
            out["tf_first_run_s"] = out["init_run_s"]
            if run_step:
                t0 = time.perf_counter()
                sess.run(train)
                out["first_step_s"] = time.perf_counter() - t0
                out["tf_first_run_s"] += out["first_step_s"]
            if run_step == "twice":   # the step's own math, without the first run's setup
                t0 = time.perf_counter()
                sess.run(train)
                out["second_step_s"] = time.perf_counter() - t0
    out["wait_s"] = out["build_s"] + out["rewrite_s"] + out["tf_first_run_s"]
    return out


def floor_child(devices, micro, towers, tiny):
    """In a fresh process of its own (the large graph of a measurement would slow it:
    Python's garbage collector walks every object alive): one ``tf.import_graph_def``
    of the user's graph per clone; with ``towers``, the ops of hand-written towers."""
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    bert = _bert(tiny)
    out = {}
    with tf.Graph().as_default() as g:
        loss = bert.model(_features(bert, ROWS * micro))
        _optimizer().minimize(loss, global_step=tf.train.get_or_create_global_step())
        user_def = g.as_graph_def()
    with tf.Graph().as_default():
        t0 = time.perf_counter()
        for c in range(devices * micro):
            tf.import_graph_def(user_def, name="clone_%d" % c)
        out["import_floor_s"] = time.perf_counter() - t0
    if towers:   # hand-written towers of the same clones (counted, not run)
        with tf.Graph().as_default() as g:
            it_ops = _features(bert, ROWS)
            opt = _optimizer()
            tower_grads = []
            for c in range(devices * micro):
                with tf.device("/cpu:%d" % (c % devices)), \
                        tf.variable_scope("", reuse=tf.AUTO_REUSE):
                    tower_grads.append(opt.compute_gradients(bert.model(it_ops)))
            avg = []
            for gvs in zip(*tower_grads):
                avg.append((tf.add_n([gr for gr, _ in gvs]) / float(len(gvs)), gvs[0][1]))
            opt.apply_gradients(avg,
                                global_step=tf.train.get_or_create_global_step())
            out["ops_towers"] = len(g.get_operations())
    return out


def _run(cmd, timeout, cfg, env=None):
    """One fresh process's RESULT (under the watchdog: bounded, nothing left behind)."""
    try:
        out = watchdog.run_one(cmd, timeout, env=env,
                               has_result=watchdog.prefixed_result("RESULT "))
    except watchdog.Failed as e:
        sys.exit("rewrite_time: configuration %s failed: %s" % (cfg, e))
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[-1][len("RESULT "):])


COLUMNS = ["config", "clones", "ops_before", "ops_after", "ops_towers", "build_s", "rewrite_s",
           "rewrite_vs_build", "init_run_s", "first_step_s", "tf_first_run_s", "wait_s",
           "second_step_s", "import_floor_s", "vs_floor"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="2x1,8x1,2x4,8x4")
    ap.add_argument("--no-step", action="store_true", help="skip the first training step")
    ap.add_argument("--repeat", type=int, default=2,
                    help="fresh processes per configuration (each one cold)")
    ap.add_argument("--second-step", action="store_true",
                    help="also time a second step (the step's math without the setup)")
    ap.add_argument("--towers", action="store_true",
                    help="also count the ops of hand-written towers")
    ap.add_argument("--tiny", action="store_true", help="the corpus's mini-BERT (quick)")
    ap.add_argument("--timeout", type=int, default=1800, help="bound of each process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None,
                    help="another source tree's EPL, measured alternately with this one")
    ap.add_argument("--child", default=None)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        d, m = (int(x) for x in a.child.split("x"))
        step = False if a.no_step else "twice" if a.second_step else True
        res = floor_child(d, m, a.towers, a.tiny) if a.floor else child(d, m, step, a.tiny)
        print("RESULT " + json.dumps(res))
        return
    rows = []
    flags = [f for f, on in (("--no-step", a.no_step), ("--second-step", a.second_step),
                             ("--towers", a.towers), ("--tiny", a.tiny)) if on]
    trees = [("this", None)]
    if a.baseline:
        base = os.path.abspath(a.baseline)
        if not os.path.isdir(os.path.join(base, "epl")):
            sys.exit("rewrite_time: --baseline %s has no epl/ package" % base)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([base] + [p for p in [env.get("PYTHONPATH")] if p])
        trees.append(("baseline", env))
    for cfg in a.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", cfg] + flags
        floor = _run(cmd + ["--floor"], a.timeout, cfg)
        for _ in range(a.repeat):
            for tree, env in trees:     # alternating: the machine's load hits both alike
                row = _run(cmd, a.timeout, cfg, env)
                row.update(floor)
                row["vs_floor"] = row["rewrite_s"] / row["import_floor_s"]
                row["tree"] = tree
                rows.append(row)
                print_table(rows[-1:], ["config", "tree", "build_s", "rewrite_s",
                                        "tf_first_run_s"])
    columns = COLUMNS[:1] + ["tree"] + COLUMNS[1:] if a.baseline else COLUMNS
    print_table(rows, columns, title="EPL rewrite of a %s graph, cold: one fresh process per "
                "row (DP devices x micro-batches)" % ("mini-BERT" if a.tiny else "BERT-base"))
    if a.baseline:
        print_table(_side_by_side(rows), ["config", "this_rewrite_s", "baseline_rewrite_s",
                                          "ratio", "this_wait_s", "baseline_wait_s", "runs"],
                    title="Medians, this tree vs the baseline %s (ratio: this / baseline)"
                    % a.baseline)
    write_json("rewrite_time", rows, a.json)


def _median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2.0


def _side_by_side(rows):
    """One row per configuration: the median rewrite and wait of each tree."""
    out = []
    for cfg in sorted(set(r["config"] for r in rows), key=[r["config"] for r in rows].index):
        mine = [r for r in rows if r["config"] == cfg and r["tree"] == "this"]
        base = [r for r in rows if r["config"] == cfg and r["tree"] == "baseline"]
        row = {"config": cfg, "runs": len(mine)}
        for key in ("rewrite_s", "wait_s"):
            row["this_" + key] = _median([r[key] for r in mine])
            row["baseline_" + key] = _median([r[key] for r in base])
        row["ratio"] = row["this_rewrite_s"] / row["baseline_rewrite_s"]
        out.append(row)
    return out


if __name__ == "__main__":
    main()
