"""Memory features side by side: peak bytes of one training step and step time, each
feature vs the same model without it (each case in its own process).

Peak: the step runs with FULL_TRACE and its allocation records (every allocator,
time-ordered, +/- bytes) are replayed; the running sum's maximum is the step's
peak (PLATFORM_NOTES "Memory on CPU").  Variables allocated before the step
(weights, slots) are not in it: it is what the step itself allocates.

Tables:
* gc:     24-layer MLP (activations dominate) and a 12-layer transformer, plain
          vs gradient_checkpoint auto / collection.  Goal (MLP): peak <= 0.5x,
          step time <= 1.4x.
* depth:  MLP of depth 8/16/32/64, plain vs auto GC: plain grows like n, GC
          like sqrt(n) (the "gc/sqrt(n)" column stays about flat).
* groups: optimizer.num_apply_group 1/2/4/8 with a hand-written AdamW whose
          temporaries (several per weight) dominate the step.
* offload: offload.level v0: bytes on the training device (variables resident
          there + the step's peak there) with and without.
* zero:   zero.level v1 vs one state per device / per worker: optimizer bytes on the
          fullest device vs 8 bytes x params / N, step time (4 devices, Adam).
* amp:    amp.level O1 (and O1 + auto GC, O1 in bfloat16) vs float32: parameter and gradient bytes
          (float32 master weights and gradients: the same; no float16 variable), the
          step's peak and time.

    python benchmarks/memory.py [--steps 5] [--tables gc,depth,groups,offload,zero,amp] [--json FILE]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import median, print_table, time_calls, write_json  # noqa: E402
from epl.ir.memory_trace import peak_bytes  # noqa: E402
import watchdog  # noqa: E402

CASE_SECONDS = 900   # the bound of one case's process

MIB = float(1 << 20)


def mlp(tf, x, depth, width):
    rng = np.random.RandomState(0)
    h = x
    for i in range(depth):
        w = (rng.randn(width, width) * (1.2 / np.sqrt(width))).astype(np.float32)
        h = tf.layers.dense(h, width, activation=tf.nn.relu, name="layer_%d" % i,
                            kernel_initializer=tf.constant_initializer(w))
        if i % 5 == 4:
            tf.add_to_collection("checkpoints", h)
    return tf.reduce_mean(tf.square(h))


def transformer(tf, x, layers, heads):
    """Pre-norm blocks: self-attention and a 4x feed-forward, residual stream."""
    batch, seq, d = x.shape.as_list()
    init = tf.glorot_uniform_initializer(seed=1)
    h = x
    for i in range(layers):
        with tf.variable_scope("block_%d" % i):
            a = _norm(tf, h)
            q, k, v = [tf.layers.dense(a, d, kernel_initializer=init, name=n) for n in "qkv"]

            def split(t):
                return tf.transpose(tf.reshape(t, [batch, seq, heads, d // heads]), [0, 2, 1, 3])
            s = tf.matmul(split(q), split(k), transpose_b=True) / np.sqrt(d // heads)
            o = tf.matmul(tf.nn.softmax(s), split(v))
            o = tf.reshape(tf.transpose(o, [0, 2, 1, 3]), [batch, seq, d])
            h = h + tf.layers.dense(o, d, kernel_initializer=init, name="o")
            f = tf.layers.dense(_norm(tf, h), 4 * d, activation=tf.nn.relu,
                                kernel_initializer=init, name="ff1")
            h = h + tf.layers.dense(f, d, kernel_initializer=init, name="ff2")
            tf.add_to_collection("checkpoints", h)
    return tf.reduce_mean(tf.square(h))


def _norm(tf, h):
    mean, var = tf.nn.moments(h, [-1], keep_dims=True)
    return (h - mean) * tf.math.rsqrt(var + 1e-6)


class AdamW(object):
    """Built on demand (needs TensorFlow): an optimizer that computes its update by
    hand with several weight-sized temporaries."""

    @staticmethod
    def make(tf, lr=1e-3):
        class _AdamW(tf.train.Optimizer):
            def __init__(self):
                super(_AdamW, self).__init__(False, "AdamW")

            def apply_gradients(self, grads_and_vars, global_step=None, name=None):
                out = []
                for g, p in grads_and_vars:
                    m = tf.get_variable(p.op.name + "/m", p.shape, trainable=False,
                                                  initializer=tf.zeros_initializer())
                    v = tf.get_variable(p.op.name + "/v", p.shape, trainable=False,
                                                  initializer=tf.zeros_initializer())
                    nm = 0.9 * m + 0.1 * g
                    nv = 0.999 * v + 0.001 * tf.square(g)
                    upd = nm / (tf.sqrt(nv) + 1e-6) + 0.01 * p
                    out += [p.assign(p - lr * upd), m.assign(nm), v.assign(nv)]
                return tf.group(*out, name=name)
        return _AdamW()


def run_case(case, steps):
    import tensorflow.compat.v1 as tf
    import epl
    tf.logging.set_verbosity(tf.logging.ERROR)
    model, feature, arg = case["model"], case["feature"], case.get("arg")
    cfg = {}
    if feature == "gc":
        cfg["gradient_checkpoint.type"] = arg
    elif feature == "groups":
        cfg["optimizer.num_apply_group"] = arg
    elif feature == "offload":
        cfg["offload.level"] = "v0"
    elif feature == "amp":
        cfg["amp.level"] = "O1"
        if arg == "bfloat16":
            cfg["amp.dtype"] = arg
        elif arg:
            cfg["gradient_checkpoint.type"] = arg
    elif feature in ("per_device", "per_worker", "zero"):
        cfg["cluster.devices_per_worker"] = case["devices"]
        if feature == "zero":
            cfg["zero.level"] = "v1"
        else:
            cfg["cluster.variable_copies"] = feature
    epl.init(epl.Config(cfg))
    if "devices" in case:
        epl.set_default_strategy(epl.replicate(1))
    rng = np.random.RandomState(0)
    adamw = case.get("optimizer") == "adamw"
    # Resource variables: an update may run as soon as its gradient is ready (a ref
    # variable's update would race with the backward pass still reading it).
    with tf.variable_scope("", use_resource=not adamw):
        if model == "mlp":
            x = tf.constant(rng.randn(case["batch"], case["width"]).astype(np.float32))
            loss = mlp(tf, x, case["depth"], case["width"])
        elif model == "transformer":
            x = tf.constant(rng.randn(case["batch"], case["seq"], case["width"])
                            .astype(np.float32))
            loss = transformer(tf, x, case["depth"], 4)
        else:
            raise ValueError(model)
    if case.get("optimizer") == "adam":
        op = tf.train.AdamOptimizer(1e-3).minimize(loss)
    elif adamw:
        # The updates wait for every gradient (ref variables, PLATFORM_NOTES), so every
        # update's temporaries could be alive at once: what grouped apply is for.
        variables = tf.trainable_variables()
        grads = tf.gradients(loss, variables)
        with tf.control_dependencies(grads):
            op = AdamW.make(tf).apply_gradients(list(zip(grads, variables)))
    else:
        op = tf.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        peaks, device_peaks = [], []
        device = "/job:localhost/replica:0/task:0/device:CPU:0"
        for _ in range(3):
            md = tf.RunMetadata()
            sess.run(op, options=tf.RunOptions(
                trace_level=tf.RunOptions.FULL_TRACE), run_metadata=md)
            peaks.append(peak_bytes(md))
            device_peaks.append(peak_bytes(md, device))
        # Variables (weights, slots) resident on the training device between steps.
        resident = sum(int(np.prod(v.shape)) * v.dtype.base_dtype.size
                       for v in tf.global_variables()
                       if v.op.device in ("", device) or v.op.device.endswith("CPU:0"))
        times = time_calls(lambda: sess.run(op), steps, warmup=1)
        final = float(sess.run(loss))
        # Optimizer state (slots, beta powers) per device, from where the variables live.
        state = {}
        for v in tf.global_variables():
            if "Adam" in v.op.name or "_power" in v.op.name:
                dev = v.op.device[-5:] if v.op.device else "CPU:0"
                state[dev] = state.get(dev, 0) + int(np.prod(v.shape)) * 4
        for op in sess.graph.get_operations():   # the replicas' copies
            if op.type in ("VariableV2", "VarHandleOp") and op.name.startswith("EPL_REPLICA_") \
                    and ("/Adam" in op.name or "_power" in op.name):
                dev = op.device[-5:]
                shape = tf.TensorShape(op.get_attr("shape"))
                state[dev] = state.get(dev, 0) + (shape.num_elements() or 1) * 4
        # Parameters (every variable the model trains, and any float16 variable) and the
        # gradients the updates read (Momentum's ApplyMomentum: input 3).
        params = sum(int(np.prod(v.shape)) * v.dtype.base_dtype.size
                     for v in tf.trainable_variables())
        half = sum(int(np.prod(v.shape)) * v.dtype.base_dtype.size
                   for v in tf.global_variables() if v.dtype.base_dtype == tf.float16)
        grads = sum(int(np.prod(op.inputs[3].shape)) * op.inputs[3].dtype.size
                    for op in sess.graph.get_operations()
                    if op.type in ("ResourceApplyMomentum", "ApplyMomentum")
                    and not op.name.startswith("EPL_REPLICA_"))
    return dict(case, peak_bytes=min(peaks), step_ms=1000 * median(times), loss=final,
                device_peak_bytes=min(device_peaks), device_resident_bytes=resident,
                optimizer_bytes_per_device=state, param_bytes=params, grad_bytes=grads,
                float16_variable_bytes=half)


def _child(case, steps):
    out = watchdog.run_one([sys.executable, os.path.abspath(__file__), "--case",
                            json.dumps(case), "--steps", str(steps)], timeout=CASE_SECONDS,
                           has_result=watchdog.has_json_result)
    return watchdog.json_result(out)


def _ratio(rows, base):
    for r in rows:
        r["peak_MiB"] = r["peak_bytes"] / MIB
        r["peak_x"] = r["peak_bytes"] / float(base["peak_bytes"])
        r["time_x"] = r["step_ms"] / base["step_ms"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--tables", default="gc,depth,groups,offload,zero,amp",
                   help="comma-separated tables to run (default: all)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case), args.steps)))
        return
    tables = set(args.tables.split(","))
    records = []

    mlp24 = {"model": "mlp", "depth": 24, "width": 256, "batch": 1024}
    tr12 = {"model": "transformer", "depth": 12, "width": 128, "seq": 128, "batch": 16}
    for base in (mlp24, tr12) if "gc" in tables else ():
        rows = [_child(dict(base, feature=f, arg=a), args.steps)
                for f, a in (("plain", None), ("gc", "auto"), ("gc", "collection"))]
        _ratio(rows, rows[0])
        goal = " (goal for the MLP: peak_x <= 0.5, time_x <= 1.4)" if base is mlp24 else ""
        print_table(rows, COLS, "gradient checkpoint, %s depth %d%s" % (
            base["model"], base["depth"], goal))
        records += [dict(r, table="gc") for r in rows]

    rows = []
    for depth in (8, 16, 32, 64) if "depth" in tables else ():
        case = {"model": "mlp", "depth": depth, "width": 256, "batch": 1024}
        plain = _child(dict(case, feature="plain"), args.steps)
        gc = _child(dict(case, feature="gc", arg="auto"), args.steps)
        rows.append({"depth": depth, "plain_MiB": plain["peak_bytes"] / MIB,
                     "gc_MiB": gc["peak_bytes"] / MIB,
                     "gc_x": gc["peak_bytes"] / float(plain["peak_bytes"]),
                     "plain/n": plain["peak_bytes"] / MIB / depth,
                     "gc/sqrt(n)": gc["peak_bytes"] / MIB / np.sqrt(depth),
                     "time_x": gc["step_ms"] / plain["step_ms"]})
    if rows:
        print_table(rows, ["depth", "plain_MiB", "gc_MiB", "gc_x", "plain/n", "gc/sqrt(n)",
                           "time_x"], "auto GC peak vs depth (MLP 256 wide, batch 1024)")
        records += [dict(r, table="depth") for r in rows]
    if "groups" in tables:
        records += _groups(args)
    if "offload" in tables:
        records += _offload(args)
    if "zero" in tables:
        records += _zero(args)
    if "amp" in tables:
        records += _amp(args)
    write_json("memory", records, args.json)


BIG = {"model": "mlp", "depth": 8, "width": 1024, "batch": 32, "optimizer": "adamw"}


COLS = ["model", "feature", "arg", "peak_MiB", "peak_x", "step_ms", "time_x"]


def _groups(args):
    rows = [_child(dict(BIG, feature="groups", arg=n), args.steps) for n in (1, 2, 4, 8)]
    _ratio(rows, rows[0])
    print_table(rows, COLS, "grouped apply, hand-written AdamW, 8 layers 1024x1024 "
                "(goal: the peak drops with more groups)")
    return [dict(r, table="groups") for r in rows]


def _offload(args):
    rows = [_child(dict(BIG, optimizer="momentum", feature=f), args.steps)
            for f in ("plain", "offload")]
    _ratio(rows, rows[0])
    for r in rows:
        r["resident_MiB"] = r["device_resident_bytes"] / MIB
        r["device_peak_MiB"] = r["device_peak_bytes"] / MIB
        r["device_MiB"] = r["resident_MiB"] + r["device_peak_MiB"]
    print_table(rows, ["model", "feature", "resident_MiB", "device_peak_MiB", "device_MiB",
                       "step_ms", "time_x"],
                "offload v0, 8 layers 1024x1024, Momentum: bytes on the training device "
                "(variables resident + the step's peak there); the host holds the variables")
    return [dict(r, table="offload") for r in rows]


def _zero(args):
    zcase = {"model": "mlp", "depth": 8, "width": 512, "batch": 256, "optimizer": "adam",
             "devices": 4}
    rows = [_child(dict(zcase, feature=f), args.steps)
            for f in ("per_device", "per_worker", "zero")]
    params = zcase["depth"] * (zcase["width"] ** 2 + zcase["width"]) * 4
    for r in rows:
        per = r["optimizer_bytes_per_device"]
        r["max_state_MiB"] = max(per.values()) / MIB
        r["devices_holding"] = len(per)
        r["formula_MiB"] = 2 * params / zcase["devices"] / MIB     # Adam: 8 bytes/param / N
        r["largest_var_MiB"] = 2 * zcase["width"] ** 2 * 4 / MIB   # (its two slots)
    base = rows[0]
    for r in rows:
        r["time_x"] = r["step_ms"] / base["step_ms"]
    print_table(rows, ["feature", "max_state_MiB", "devices_holding", "formula_MiB",
                       "largest_var_MiB", "step_ms", "time_x"],
                "ZeRO v1, Adam, MLP 8 x 512 on 4 devices: optimizer state on the fullest "
                "device (goal: <= formula 8 B x params / N + the largest variable's slots)")
    return [dict(r, table="zero") for r in rows]


def _amp(args):
    amp_case = {"model": "mlp", "depth": 4, "width": 256, "batch": 256}
    rows = [_child(dict(amp_case, feature=f, arg=a), args.steps)
            for f, a in (("plain", None), ("amp", None), ("amp", "auto"), ("amp", "bfloat16"))]
    _ratio(rows, rows[0])
    for r in rows:
        r["params_MiB"] = r["param_bytes"] / MIB
        r["grads_MiB"] = r["grad_bytes"] / MIB
        r["fp16_vars_MiB"] = r["float16_variable_bytes"] / MIB
    print_table(rows, COLS[:3] + ["params_MiB", "grads_MiB", "fp16_vars_MiB"] + COLS[3:],
                "AMP O1 (arg: with GC, or bfloat16), MLP 4 x 256, batch 256: the step's peak "
                "(float16 activations of the products) and time (CPU float16 kernels are slow)")
    return [dict(r, table="amp") for r in rows]


if __name__ == "__main__":
    main()
