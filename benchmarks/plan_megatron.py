"""The scale planner against Megatron-LM's Table 1 (Narayanan et al., SC'21, arXiv
2104.04473): GPT models of 1.7B-1T parameters on 32-3072 A100-80GB.

For each row: the model as a TF1 graph (2 blocks built, repeated to the row's layers),
the paper's layout (t, p, d, global batch; mixed precision, full recomputation, the
interleaved 1F1B schedule with 2 chunks (3 where the stage's blocks are odd); the paper
does not list micro-batch sizes, so the fastest of 1/2/4/8 that fits) priced on the
``a100-80gb`` preset; its TFLOP/s per GPU vs the paper's (goal: within 15%); the FLOPs
EPL counts vs Eq. 3 (goal: within 2%); the model state per device vs the closed form
16 bytes x parameters on the device (exact); and whether ``plan`` finds a layout
predicted at least as fast (searching the same schedules, and EPL's 1F1B only).

    python benchmarks/plan_megatron.py [--rows 0,6] [--fit 0,6] [--json out.json]

``--fit`` fits the one efficiency constant of A100 16-bit matrix products on those rows
(the geometric mean of their paper/predicted ratios), and prints it.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epl.auto import graph_profile, machines  # noqa: E402
from epl.auto.gpt import GPT, table1  # noqa: E402
from epl.auto.layout import Layout  # noqa: E402
from epl.auto.planner import plan  # noqa: E402
from epl.auto.predictor import price  # noqa: E402


def closed_form_state(row, k):
    """16 bytes (16-bit weight and gradient, fp32 master, Adam m and v) x the parameters
    stage k's devices hold: 12h^2/t + 13h per block, the embeddings (V+s)h/t on the
    first stage, the tied LM head Vh/t (when p > 1) and the final LayerNorm 2h on the
    last."""
    l, h, t, p = row["layers"], row["hidden"], row["t"], row["p"]
    V, s = 51200, 2048
    base, extra = divmod(l, p)
    blocks = base + (1 if k < extra else 0)
    n = blocks * (12 * h * h / float(t) + 13 * h)
    if k == 0:
        n += (V + s) * h / float(t)
    if k == p - 1:
        n += 2 * h + (V * h / float(t) if p > 1 else 0)
    return 16 * n


def paper_layout(row, mb):
    per_stage = row["layers"] // row["p"]
    chunks = 2 if per_stage % 2 == 0 else 3
    return Layout(t=row["t"], p=row["p"], d=row["d"], micro_batch_size=mb,
                  schedule="interleaved" if row["p"] > 1 else "1f1b", chunks=chunks,
                  recompute=True, dtype="fp16")


def evaluate(row, profile, cluster):
    best = None
    for mb in (1, 2, 4, 8):
        per = row["batch"] // row["d"]
        if per % mb:
            continue
        pred = price(profile, paper_layout(row, mb), cluster, row["batch"])
        if pred.fits and (best is None or pred.step_time_s < best.step_time_s):
            best = pred
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="0,10")
    ap.add_argument("--fit", default="")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--json", default="benchmarks/results/plan_megatron.json")
    args = ap.parse_args()
    rows = table1()
    lo, hi = [int(x) for x in args.rows.split(",")]
    cache = {}

    def profile(row):
        key = (row["hidden"], row["heads"])
        if key not in cache:
            m = GPT(2, row["hidden"], row["heads"])
            cache[key] = graph_profile.profile(m.model_fn, m.dataset_fn, m.optimizer_fn)
        return cache[key].repeated(row["layers"])

    def cluster(row):
        return machines.Cluster.preset("a100-80gb", nodes=row["gpus"] // 8)

    if args.fit:
        fit_rows = [rows[int(i)] for i in args.fit.split(",")]
        logs = []
        for row in fit_rows:
            pred = evaluate(row, profile(row), cluster(row))
            logs.append(math.log(row["tflops"] / pred.tflops_per_gpu))
        # compute time is ~ 1/efficiency: scale, then iterate (communication does not scale)
        eff = machines.FITTED_EFFICIENCY
        for _ in range(6):
            eff *= math.exp(sum(logs) / len(logs))
            logs = []
            for row in fit_rows:
                c = cluster(row)
                c.device.efficiency["fp16"] = eff
                logs.append(math.log(row["tflops"] / evaluate(row, profile(row), c)
                                     .tflops_per_gpu))
        print("fitted efficiency (A100 fp16) on rows %s: %.4f" % (args.fit, eff))
        return

    out = []
    head = ("%-7s %-12s %4s %7s %7s %6s %9s %9s %8s %10s %s" % (
        "params", "t/p/d", "mb", "pred", "paper", "err%", "flops/Eq3", "state_ok",
        "peak_GiB", "plan_best", "plan(1f1b only)"))
    print(head)
    for row in rows[lo:hi]:
        start = time.time()
        prof, c = profile(row), cluster(row)
        pred = evaluate(row, prof, c)
        eq3 = GPT(row["layers"], row["hidden"], row["heads"]).flops(row["batch"])
        flops_ratio = pred.breakdown["executed_flops"] / eq3
        state_ok = all(
            abs(st["weights"] + st["gradients"] + st["optimizer_states"]
                - closed_form_state(row, st["stage"])) < 1e-6 * closed_form_state(row, 0)
            for st in pred.breakdown["stages"])
        err = pred.tflops_per_gpu / row["tflops"] - 1
        entry = dict(row, micro_batch=pred.layout.micro_batch_size,
                     predicted_tflops=pred.tflops_per_gpu, error=err,
                     flops_vs_eq3=flops_ratio, model_state_exact=state_ok,
                     peak_memory_gib=pred.peak_memory_bytes / 2.0 ** 30,
                     breakdown={k: v for k, v in pred.breakdown.items() if k != "stages"})
        plan_txt = ""
        if not args.no_plan:
            same = plan(None, None, None, c, row["batch"], profile=prof, amp="float16",
                        schedules=("1f1b", "interleaved"), recompute=(True, False),
                        zero=(None,), micro_batch_sizes=(1, 2, 4, 8))
            epl_only = plan(None, None, None, c, row["batch"], profile=prof, amp="float16",
                            zero=(None, "v1"), micro_batch_sizes=(1, 2, 4, 8))
            b1, b2 = same.best.prediction, epl_only.best.prediction
            entry.update(plan_best=b1.layout.describe(), plan_best_tflops=b1.tflops_per_gpu,
                         plan_at_least_paper=b1.samples_per_s >= pred.samples_per_s * (1 - 1e-9),
                         plan_1f1b_best=b2.layout.describe(),
                         plan_1f1b_tflops=b2.tflops_per_gpu,
                         plan_seconds=same.seconds + epl_only.seconds)
            plan_txt = "%s %.0f %s | %s %.0f" % (
                "yes" if entry["plan_at_least_paper"] else "NO", b1.tflops_per_gpu,
                b1.layout.describe(), b2.layout.describe(), b2.tflops_per_gpu)
        entry["seconds"] = time.time() - start
        out.append(entry)
        print("%-7s %-12s %4d %7.1f %7d %6.1f %9.4f %9s %8.1f %s" % (
            row["params_b"], "%d/%d/%d" % (row["t"], row["p"], row["d"]),
            pred.layout.micro_batch_size, pred.tflops_per_gpu, row["tflops"], 100 * err,
            flops_ratio, state_ok, entry["peak_memory_gib"], plan_txt))
        sys.stdout.flush()
    errs = [abs(e["error"]) for e in out]
    print("efficiency constant (A100 fp16): %.4f; max |error| %.1f%%, mean %.1f%%" % (
        machines.FITTED_EFFICIENCY, 100 * max(errs), 100 * sum(errs) / len(errs)))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(efficiency=machines.FITTED_EFFICIENCY, rows=out), f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
