"""``python -m epl.plan``: rank the layouts of a model on a cluster (docs/plan.md).

    python -m epl.plan --gpt 96,12288,96 --cluster a100-80gb --nodes 128 \\
        --global-batch 1536 --amp float16 --json plan.json
    python -m epl.plan --model mypkg.models:my_model --cluster cluster.json ...

``--model module:attr`` names an object with ``model_fn``, ``dataset_fn`` and
``optimizer_fn`` (or ``--model_fn/--dataset_fn/--optimizer_fn module:fn`` each);
``--gpt L,H,A[,S,V]`` the built-in GPT decoder (2 blocks built, repeated to L).
``--cluster``: a preset name (``--nodes``), a JSON file (``Cluster.to_json``'s form), or
``local``: this machine as EPL runs it (``Cluster.local``: ``--devices`` virtual CPU
devices in each of ``--nodes`` worker processes), its calibration and the model's
kernels timed here the first time (cached; ``--no-kernel-timing`` prices the kernels by
the calibrated FLOP/s and bandwidth instead).

    python -m epl.plan --model mypkg.models:my_model --cluster local --devices 4 \
        --global-batch 256 --split-variant 2=mypkg.models:my_model_split2

``--split-variant T=module:fn`` (repeatable; ``--cluster local``): the model built with
its own ``epl.split(T)`` scopes: its layouts of split degree T are priced on the step
EPL builds of it, replayed (``plan``'s ``split_variants``), not by region.
"""
import argparse
import importlib
import os
import sys

from epl.auto import Cluster, plan
from epl.auto.gpt import GPT
from epl.plan import chart


def _load(spec):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def _split_variants(ap, specs):
    """{t: model_fn} of ``--split-variant T=module:fn`` values."""
    out = {}
    for spec in specs or ():
        degree, _, fn = spec.partition("=")
        if not degree.isdigit() or int(degree) < 2 or ":" not in fn:
            ap.error("--split-variant: want T=module:fn with T >= 2 (the split degree of "
                     "the model_fn built under epl.split(T)), got %r" % spec)
        out[int(degree)] = _load(fn)
    return out


def _cluster(ap, args):
    """The cluster of ``--cluster``; what does not apply to it is refused by name."""
    local = args.cluster == "local"
    if not local and (args.devices is not None or not args.kernel_timing
                      or args.split_variant):
        ap.error("--devices, --no-kernel-timing and --split-variant are for --cluster "
                 "local (a preset's nodes have 8 GPUs; a JSON file says its own)")
    if local and args.png:
        ap.error("--png draws clusters of 8 .. 1024 GPUs; give a preset or a JSON file "
                 "(--cluster local plans this machine only)")
    if args.nodes < 1 or (args.devices is not None and args.devices < 1):
        ap.error("--nodes and --devices must be >= 1, got %s and %s"
                 % (args.nodes, args.devices))
    if local:
        return Cluster.local(args.devices or os.cpu_count() or 1, processes=args.nodes,
                             products=args.kernel_timing)
    if args.cluster.endswith(".json"):
        return Cluster.from_json(args.cluster)
    return Cluster.preset(args.cluster, nodes=args.nodes)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m epl.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--gpt", help="L,H,A[,S,V]: the built-in GPT decoder")
    ap.add_argument("--model", help="module:attr with model_fn, dataset_fn, optimizer_fn")
    ap.add_argument("--model_fn")
    ap.add_argument("--dataset_fn")
    ap.add_argument("--optimizer_fn")
    ap.add_argument("--layers", type=int, help="blocks of the model when fewer are built")
    ap.add_argument("--cluster", default="a100-80gb",
                    help="preset name, JSON file, or local (this machine)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="nodes of the preset; with --cluster local: worker processes")
    ap.add_argument("--devices", type=int,
                    help="--cluster local: virtual CPU devices per process (default: the "
                    "cores)")
    ap.add_argument("--no-kernel-timing", dest="kernel_timing", action="store_false",
                    help="--cluster local: price the model's kernels by the calibration's "
                    "FLOP/s and bandwidth, without timing them here")
    ap.add_argument("--split-variant", action="append", metavar="T=module:fn",
                    help="the model built under its own epl.split(T) scopes (--cluster "
                    "local; repeatable): its split degree T priced on EPL's built step")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--amp", choices=("float16", "bfloat16"))
    ap.add_argument("--offload", action="store_true", help="also try optimizer offload")
    ap.add_argument("--interleaved", action="store_true",
                    help="also price the interleaved schedule (EPL does not run it)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the ranked candidates here")
    ap.add_argument("--png", help="draw the best layout's samples/s and memory per device "
                    "at 8 .. 1024 GPUs and the winner's breakdown here (epl.plan.chart)")
    args = ap.parse_args(argv)

    layers = args.layers
    if args.gpt:
        dims = [int(x) for x in args.gpt.split(",")]
        model = GPT(min(2, dims[0]), dims[1], dims[2], *dims[3:])
        layers = layers or dims[0]
        fns = (model.model_fn, model.dataset_fn, model.optimizer_fn)
    elif args.model:
        obj = _load(args.model)
        fns = (obj.model_fn, obj.dataset_fn, obj.optimizer_fn)
    elif args.model_fn and args.dataset_fn and args.optimizer_fn:
        fns = (_load(args.model_fn), _load(args.dataset_fn), _load(args.optimizer_fn))
    else:
        ap.error("give --gpt, --model, or all of --model_fn --dataset_fn --optimizer_fn")
    cluster = _cluster(ap, args)
    options = {}
    if args.offload:
        options["offload"] = (False, True)
    if args.interleaved:
        options["schedules"] = ("1f1b", "interleaved")
    report = plan(fns[0], fns[1], fns[2], cluster, args.global_batch, layers=layers,
                  amp=args.amp, split_variants=_split_variants(ap, args.split_variant),
                  **options)
    print("%s, %d devices, %.4g parameters, global batch %d" % (
        cluster, cluster.num_devices, report.profile.params(), args.global_batch))
    print(report.table(args.top))
    if report.best is not None:
        print("best strategy: %s" % (report.best.strategy,))
        for need in report.best.requires:
            print("  it needs %s" % need)
    if args.json:
        report.to_json(args.json)
        print("wrote %s" % args.json)
    if args.png:
        points = chart.series(report.profile, cluster, args.global_batch, amp=args.amp,
                              **options)
        title = "%s on %s, global batch %d" % (args.gpt and "GPT " + args.gpt or args.model
                                               or args.model_fn, cluster.device.name,
                                               args.global_batch)
        chart.render(points, report.best.prediction if report.best else None, title,
                     cluster.device.memory).save(args.png)
        print("wrote %s" % args.png)
    return 0 if report.best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
