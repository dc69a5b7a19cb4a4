"""Tensor-parallel transformer blocks (issue 35): a GPT-style decoder (tests/
transformer_models.py, plain TF1 code) under ``epl.split(1/2/4)`` against the same
model without EPL, side by side in one run.  Per configuration:

* ``step_ms``: median time of a training step (Adam);
* ``moved_mib``: bytes moved between devices per step, read from the rewritten graph
  of the step (every tensor a step op reads from another device, once per reading
  device; an EPL collective op counts as a ring: 2 (n-1)/n of its tensor per rank);
* ``fwd_sums`` / ``bwd_sums``: per block, the sums of the shards' partial results that
  cross devices (forward: the attention's output projection and the MLP's second
  layer; backward: the gradients of the column-parallel layers' inputs);
* per-device peak bytes of a traced step (``epl/ir/memory_trace.py``: activations and
  temporaries, variables excluded) and per-device bytes of variables (weights + Adam).

A second table decides the layout of what stays unsharded (LayerNorm, residuals):
the same blocks written by hand with ``tf.device`` (no EPL), in two layouts:

* ``shared``: the partial products are summed on device 0 (an ``AddN``), LayerNorm and
  the residual run once there, and the other devices read its result (EPL's layout);
* ``replicated``: Megatron-LM's, an all-reduce (EPL's communicator) after the attention
  and after the MLP, LayerNorm and the residual on every device.

Both compute the same loss (checked, 1e-4); each configuration runs in its own process.

    python benchmarks/tp_transformer.py [--hidden 256] [--seq 64] [--layers 4] [--json F]
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

from common import median, print_table, time_calls, write_json  # noqa: E402
import watchdog  # noqa: E402

MIB = 1024.0 * 1024.0


def _step_ops(op):
    """The ops a run of ``op`` executes (its data and control inputs, transitively)."""
    from epl import ir  # (in the child: the parent process imports no TensorFlow)
    return ir.upstream([op])


def _dev(d):
    import tensorflow.compat.v1 as tf
    return tf.DeviceSpec.from_string(d or "").to_string()


def _nbytes(t):
    if not t.shape.is_fully_defined():
        return None
    return int(np.prod(t.shape.as_list())) * t.dtype.size


def moved_bytes(ops):
    """(bytes, edges of unknown size) a step moves between devices (see the docstring)."""
    sent, total, unknown = set(), 0, 0
    for o in ops:
        if o.type.startswith("EplAllReduce"):
            n = o.get_attr("size")
            for t in o.inputs:
                b = _nbytes(t)
                total += 2 * (n - 1) * b // n if b is not None else 0
        for t in o.inputs:
            src, dst = _dev(t.op.device), _dev(o.device)
            if src == dst or (t, dst) in sent:
                continue
            sent.add((t, dst))
            b = _nbytes(t)
            if b is None:
                unknown += 1
            else:
                total += b
    return total, unknown


def _block(o, layers, depth=2):
    """The block an op belongs to: by its name, else by its inputs' (``depth`` ops back;
    a gradient sum's inputs may be sums themselves)."""
    for b in range(layers):
        if "block_%d/" % b in o.name:
            return b
    for t in o.inputs if depth else ():
        b = _block(t.op, layers, depth - 1)
        if b is not None:
            return b
    return None


def sums_per_block(ops, layers):
    """Per block: the forward and backward sums of activation-shaped partials (rank >= 3)
    whose inputs come from several devices: an AddN, or a collective all-reduce (counted
    once, by its rank 0 op).  LayerNorm parameters' gradient sums are not counted."""
    fwd, bwd = [0] * layers, [0] * layers
    for o in ops:
        if not o.inputs or (o.inputs[0].shape.ndims or 0) < 3:
            continue
        if o.type.startswith("EplAllReduce"):
            if o.get_attr("rank") != 0:
                continue
        elif o.type != "AddN" or len(set(_dev(t.op.device) for t in o.inputs)) < 2:
            continue
        b = _block(o, layers)
        if b is not None:
            (bwd if "gradients" in o.name else fwd)[b] += 1
    return fwd, bwd


def _peaks(md, variables):
    from epl.ir.memory_trace import peak_bytes
    peaks = {}
    for dev in md.step_stats.dev_stats:
        if "/device:" in dev.device:
            peaks[_dev(dev.device)] = peak_bytes(md, dev.device)
    var_bytes = {}
    for v in variables:
        d = _dev(v.op.device)
        var_bytes[d] = var_bytes.get(d, 0) + int(np.prod(v.shape.as_list())) * v.dtype.size
    return peaks, var_bytes


def _measure(sess, op, loss, feed, steps, layers, variables):
    from epl.ir.memory_trace import traced_run
    first_loss = float(sess.run(loss, feed))
    times = time_calls(lambda: sess.run(op, feed), steps, warmup=2)
    (_, loss_value), md = traced_run(sess, [op, loss], feed)
    ops = _step_ops(op)
    moved, unknown = moved_bytes(ops)
    fwd, bwd = sums_per_block(ops, layers)
    peaks, var_bytes = _peaks(md, variables)
    return {"step_ms": 1000 * median(times), "moved_mib": moved / MIB, "unknown_edges": unknown,
            "fwd_sums": fwd, "bwd_sums": bwd, "first_loss": first_loss, "loss": float(loss_value),
            "peak_mib_per_device": [peaks[d] / MIB for d in sorted(peaks)],
            "var_mib_per_device": [var_bytes[d] / MIB for d in sorted(var_bytes)]}


def _optimizer(a):
    import tensorflow.compat.v1 as tf
    if a.optimizer == "sgd":
        return tf.train.GradientDescentOptimizer(0.01)
    return tf.train.AdamOptimizer(1e-3, epsilon=1e-4)


def run_epl(mode, a):
    """``mode``: 'local' (no EPL) or 'split<n>'."""
    import tensorflow.compat.v1 as tf
    from tests import transformer_models as tm
    tf.logging.set_verbosity(tf.logging.ERROR)
    tm.SEQ = a.seq   # (the model reads it when it builds)
    model = tm.Decoder(width=a.hidden, heads=a.heads, layers=a.layers)
    n = None if mode == "local" else int(mode[5:])
    if n is not None:
        import epl
        epl.init(epl.Config({"cluster.devices_per_worker": n}))
    ids, labels = tm.data(a.batch)
    pi = tf.placeholder(tf.int64, [a.batch, a.seq])
    pl = tf.placeholder(tf.int64, [a.batch, a.seq])
    if n is None:
        loss = model.build(pi, pl)
    else:
        with epl.split(n):
            loss = model.build(pi, pl)
    op = _optimizer(a).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        out = _measure(sess, op, loss, {pi: ids, pl: labels}, a.steps, a.layers,
                       tf.global_variables())
    out.update(table="epl", mode=mode, devices=n or 1)
    return out


def _layer_norm(x, gamma, beta):
    import tensorflow.compat.v1 as tf
    mean, var = tf.nn.moments(x, [-1], keep_dims=True)
    return (x - mean) * tf.rsqrt(var + 1e-5) * gamma + beta


def run_layout(layout, n, a):
    """The hand-written blocks (module docstring), ``n`` devices."""
    import tensorflow.compat.v1 as tf
    from epl import communicators
    tf.logging.set_verbosity(tf.logging.ERROR)
    d, h, s, b = a.hidden, a.heads, a.seq, a.batch
    hd = d // h
    devs = ["/job:localhost/replica:0/task:0/device:CPU:%d" % i for i in range(n)]
    heads = [len(c) for c in np.array_split(np.arange(h), n)]
    rng = np.random.RandomState(0)
    full = {k: (rng.randn(*shape) * 0.05).astype(np.float32) for k, shape in
            [("x", [b, s, d])] + [("%s%d" % (w, i), [d, d] if w != "fc" else [d, 4 * d])
                                  for i in range(a.layers) for w in ("q", "k", "v", "o")]
            + [("fc%d" % i, [d, 4 * d]) for i in range(a.layers)]
            + [("out%d" % i, [4 * d, d]) for i in range(a.layers)]}
    comm = communicators.create(devs, "tp_bench") if layout == "replicated" else None
    mask = (1.0 - np.tril(np.ones([s, s], np.float32))) * -1e9

    def var(name, i, cols=None, rows=None):
        value = full[name]
        if cols is not None:
            value = value[:, cols]
        if rows is not None:
            value = value[rows]
        with tf.device(devs[i]):
            return tf.Variable(value, name="%s_part_%d" % (name, i))

    def combine(partials, xs):
        """x + sum(partials): on device 0 (shared) or all-reduced (replicated)."""
        if layout == "shared":
            with tf.device(devs[0]):
                return [xs[0] + tf.add_n(partials)]
        total = comm.all_reduce(partials)
        outs = []
        for i in range(n):
            with tf.device(devs[i]):
                outs.append(xs[i] + total[i])
        return outs

    def norm(xs, name):
        with tf.device(devs[0]):
            gamma = tf.Variable(np.ones([d], np.float32), name=name + "_gamma")
            beta = tf.Variable(np.zeros([d], np.float32), name=name + "_beta")
        outs = []
        for i, x in enumerate(xs):
            with tf.device(devs[i]):
                outs.append(_layer_norm(x, gamma, beta))
        return outs

    with tf.device(devs[0]):
        x0 = tf.constant(full["x"])
    xs = [x0] if layout == "shared" else [tf.identity(x0) for _ in range(n)]
    for blk in range(a.layers):
        with tf.name_scope("block_%d" % blk):
            ln = norm(xs, "ln1_%d" % blk)
            partials, start = [], 0
            for i in range(n):
                cols = slice(start * hd, (start + heads[i]) * hd)
                start += heads[i]
                a_i = ln[i if layout == "replicated" else 0]
                with tf.device(devs[i]):
                    q, k, v = [tf.transpose(tf.reshape(tf.tensordot(
                        a_i, var("%s%d" % (w, blk), i, cols=cols), 1), [b, s, heads[i], hd]),
                        [0, 2, 1, 3]) for w in ("q", "k", "v")]
                    p = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(hd) + mask)
                    o = tf.reshape(tf.transpose(tf.matmul(p, v), [0, 2, 1, 3]),
                                   [b, s, heads[i] * hd])
                    partials.append(tf.tensordot(o, var("o%d" % blk, i, rows=cols), 1))
            xs = combine(partials, xs)
            ln = norm(xs, "ln2_%d" % blk)
            partials, units = [], np.array_split(np.arange(4 * d), n)
            for i in range(n):
                cols = slice(units[i][0], units[i][-1] + 1)
                with tf.device(devs[i]):
                    hid = tf.nn.relu(tf.tensordot(ln[i if layout == "replicated" else 0],
                                                  var("fc%d" % blk, i, cols=cols), 1))
                    partials.append(tf.tensordot(hid, var("out%d" % blk, i, rows=cols), 1))
            xs = combine(partials, xs)
    # Every rank's last all-reduce must run: the loss reads every copy (each 1/n).
    parts = []
    for i, x in enumerate(xs):
        with tf.device(devs[i]):
            parts.append(tf.reduce_mean(tf.square(x)) / len(xs))
    with tf.device(devs[0]):
        loss = tf.add_n(parts)
    # (gradients on their forward op's device, as EPL places them)
    op = _optimizer(a).minimize(loss, colocate_gradients_with_ops=True)
    config = tf.ConfigProto(device_count={"CPU": n}, allow_soft_placement=False)
    with tf.Session(config=config) as sess:
        sess.run(tf.global_variables_initializer())
        out = _measure(sess, op, loss, None, a.steps, a.layers, tf.global_variables())
    out.update(table="layout", mode=layout, devices=n)
    return out


def _child(kind, mode, n, a):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--mode", mode,
           "--n", str(n)]
    for k in ("hidden", "heads", "seq", "layers", "batch", "steps", "optimizer"):
        cmd += ["--" + k, str(getattr(a, k))]
    out = watchdog.run_one(cmd, timeout=900, has_result=watchdog.prefixed_result("RESULT "))
    return json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][0][7:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        out = run_epl(a.mode, a) if a.child == "epl" else run_layout(a.mode, a.n, a)
        print("RESULT " + json.dumps(out))
        return
    splits = [int(x) for x in a.splits.split(",")]
    rows = [_child("epl", "local", 1, a)] + [_child("epl", "split%d" % n, n, a) for n in splits]
    local = rows[0]
    for r in rows:
        r["step_ratio_vs_local"] = r["step_ms"] / local["step_ms"]
        r["max_peak_ratio_vs_local"] = max(r["peak_mib_per_device"]) / max(
            local["peak_mib_per_device"])
        r["max_var_ratio_vs_local"] = max(r["var_mib_per_device"]) / max(
            local["var_mib_per_device"])
        r["first_loss_rel_err"] = abs(r["first_loss"] - local["first_loss"]) / local["first_loss"]
        r["loss_rel_err"] = abs(r["loss"] - local["loss"]) / abs(local["loss"])
    cols = ["mode", "step_ms", "step_ratio_vs_local", "moved_mib", "fwd_sums", "bwd_sums",
            "peak_mib_per_device", "max_peak_ratio_vs_local", "var_mib_per_device",
            "max_var_ratio_vs_local", "first_loss_rel_err", "loss_rel_err"]
    title = ("GPT-style decoder, hidden %d, %d heads, seq %d, %d blocks, batch %d: EPL split "
             "vs local (one step = Adam update)" % (a.hidden, a.heads, a.seq, a.layers, a.batch))
    print_table(rows, cols, title=title)
    layouts = []
    for n in [s for s in splits if s > 1]:
        pair = [_child("layout", m, n, a) for m in ("shared", "replicated")]
        if abs(pair[0]["first_loss"] - pair[1]["first_loss"]) > 1e-5 * pair[0]["first_loss"]:
            raise SystemExit("layouts disagree: %s" % [r["first_loss"] for r in pair])
        for r in pair:
            r["step_ratio_vs_shared"] = r["step_ms"] / pair[0]["step_ms"]
            r["device0_peak_ratio_vs_shared"] = (r["peak_mib_per_device"][0]
                                                 / pair[0]["peak_mib_per_device"][0])
        layouts += pair
    print_table(layouts, ["devices", "mode", "step_ms", "step_ratio_vs_shared", "moved_mib",
                          "fwd_sums", "bwd_sums", "peak_mib_per_device",
                          "device0_peak_ratio_vs_shared"],
                title="Hand-written blocks (tf.device, same sizes): sum on device 0 + LayerNorm "
                      "once (shared) vs all-reduce + LayerNorm on every device (replicated)")
    write_json("tp_transformer", {"config": vars(a), "epl": rows, "layouts": layouts}, a.json)


if __name__ == "__main__":
    main()
