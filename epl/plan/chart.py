"""The planner's picture (``python -m epl.plan --png``): how the best layout scales.

Left: predicted samples/s (top) and memory per device (bottom) of the best layout
``plan`` finds at each GPU count, 8 -> 1024 in powers of two (the cluster's nodes
changed, its devices kept), on a log-2 axis; the device memory is a dashed line.
Right: the breakdown of the winner (the plan of the cluster asked for): its step time
split into compute, communication, bubble and update, and its fullest device's bytes.

``series`` is the data, ``render`` draws it with ``epl.plan.png`` (no imaging
library needed) and records where each point landed (``Chart.points``), so that a
test can check the picture against the plan.
"""
import math

from epl.auto.planner import plan
from epl.plan.png import Canvas

SIZES = tuple(2 ** k for k in range(3, 11))      # 8 .. 1024 GPUs
WIDTH, HEIGHT = 960, 640
GiB = float(2 ** 30)
_INK, _GRID, _MUTED = (0, 0, 0), (225, 225, 225), (110, 110, 110)
_BLUE, _RED = (31, 100, 180), (200, 60, 40)
_TIME_PARTS = (("compute_s", "compute", (31, 100, 180)),
               ("tp_comm_s", "tensor-parallel comm", (240, 150, 30)),
               ("pp_send_s", "pipeline sends", (60, 160, 60)),
               ("bubble_s", "pipeline bubble", (190, 190, 190)),
               ("dp_exposed_s", "data-parallel comm (exposed)", (200, 60, 40)),
               ("optimizer_s", "optimizer update", (140, 90, 170)),
               ("zero_allgather_s", "ZeRO all-gather", (120, 70, 50)),
               ("offload_s", "offload copies", (230, 120, 190)))
_MEMORY_PARTS = (("weights", "weights", (31, 100, 180)),
                 ("gradients", "gradients", (240, 150, 30)),
                 ("optimizer_states", "optimizer states", (140, 90, 170)),
                 ("activations", "activations", (60, 160, 60)),
                 ("buffers", "buffers", (190, 190, 190)))


def series(profile, cluster, global_batch, sizes=SIZES, **plan_kw):
    """[{gpus, samples_per_s, peak_memory_bytes, layout, prediction}] of the best
    layout at each size of ``sizes`` that whole nodes of ``cluster`` make (ascending);
    None figures where no layout fits.  ``plan_kw``: ``plan``'s options (``amp``...)."""
    per_node = cluster.devices_per_node
    out = []
    for n in sorted(sizes):
        if n % per_node:
            continue
        report = plan(None, None, None, cluster.with_nodes(n // per_node), global_batch,
                      profile=profile, **plan_kw)
        best = report.best
        pred = best.prediction if best is not None else None
        out.append(dict(gpus=n, samples_per_s=pred.samples_per_s if pred else None,
                        peak_memory_bytes=pred.peak_memory_bytes if pred else None,
                        layout=pred.layout.describe() if pred else None, prediction=pred))
    return out


def _nice_max(v):
    """The smallest 1, 2, 2.5 or 5 x 10^k at or above v (axis top)."""
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for f in (1, 2, 2.5, 5, 10):
        if f * exp >= v * (1 - 1e-12):
            return f * exp
    return 10 * exp


def fmt(v):
    """Compact tick labels: 1.5k, 2M, 0.25."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return ("%.3g" % (v / div)) + suffix
    return "%.3g" % v


class Chart(object):
    """A rendered chart: ``canvas`` and ``points`` ([(series name, gpus, value, x,
    y)] in pixels) of the two line plots."""

    def __init__(self, canvas, points):
        self.canvas, self.points = canvas, points

    def save(self, path):
        self.canvas.save(path)


def _plot(cv, box, xs, ys, top, color, title, unit, limit=None):
    """One line plot in ``box`` (x0, y0, x1, y1): log-2 x of the GPU counts, linear y
    from 0 to ``top``; returns the points' pixels."""
    x0, y0, x1, y1 = box
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])

    def px(n):
        return x0 if hi == lo else x0 + (math.log2(n) - lo) / (hi - lo) * (x1 - x0)

    def py(v):
        return y1 - v / top * (y1 - y0)
    for i in range(5):
        v = top * i / 4.0
        cv.line(x0, py(v), x1, py(v), _GRID)
        cv.text(x0 - 6, int(py(v)) - 3, fmt(v), _MUTED, align="right")
    for n in xs:
        cv.line(px(n), y0, px(n), y1, _GRID)
        cv.text(int(px(n)), y1 + 6, str(n), _MUTED, align="center")
    cv.line(x0, y1, x1, y1, _INK)
    cv.line(x0, y0, x0, y1, _INK)
    cv.text(x0, y0 - 14, "%s (%s)" % (title, unit), _INK)
    if limit is not None and limit <= top:
        for xa in range(int(x0), int(x1), 8):
            cv.line(xa, py(limit), min(xa + 4, x1), py(limit), _RED)
        cv.text(int(x1), int(py(limit)) - 10, "device memory", _RED, align="right")
    pts = [(n, v, px(n), py(v)) for n, v in zip(xs, ys) if v is not None]
    for a, b in zip(pts, pts[1:]):
        cv.line(a[2], a[3], b[2], b[3], color, width=2)
    for _, _, x, y in pts:
        cv.rect(x - 3, y - 3, x + 3, y + 3, color)
    return pts


def _stacked(cv, x, y, width, parts, values, title, unit_fmt):
    """One horizontal bar of the parts' values (left to right) and its legend."""
    total = sum(max(values.get(k, 0.0), 0.0) for k, _, _ in parts) or 1.0
    cv.text(x, y, title, _INK)
    at, bar_y = x, y + 14
    for key, _, color in parts:
        w = max(values.get(key, 0.0), 0.0) / total * width
        if w > 0:
            cv.rect(at, bar_y, at + w, bar_y + 22, color)
            at += w
    cv.line(x, bar_y + 23, x + width, bar_y + 23, _INK)
    row = bar_y + 32
    for key, label, color in parts:
        v = values.get(key, 0.0)
        if v <= 0:
            continue
        cv.rect(x, row, x + 8, row + 6, color)
        cv.text(x + 14, row, "%s %s (%.0f%%)" % (label, unit_fmt(v), 100 * v / total), _INK)
        row += 12
    return row


def render(points, winner=None, title="", device_memory=None):
    """The chart of ``series(...)``'s points and the winner's ``Prediction``."""
    cv = Canvas(WIDTH, HEIGHT)
    cv.text(20, 12, title[:150], _INK)
    xs = [p["gpus"] for p in points]
    out = []
    if xs:
        rates = [p["samples_per_s"] for p in points]
        mems = [p["peak_memory_bytes"] / GiB if p["peak_memory_bytes"] else None
                for p in points]
        top_rate = _nice_max(max([r for r in rates if r] or [1.0]) * 1.05)
        limit = device_memory / GiB if device_memory else None
        top_mem = _nice_max(max([m for m in mems if m] + [limit or 0.0] or [1.0]) * 1.05)
        for n, v, x, y in _plot(cv, (90, 60, 540, 300), xs, rates, top_rate, _BLUE,
                                "best layout: samples/s", "predicted"):
            out.append(("samples_per_s", n, v, x, y))
        for n, v, x, y in _plot(cv, (90, 370, 540, 600), xs, mems, top_mem, _RED,
                                "its memory per device", "GiB", limit):
            out.append(("memory_gib", n, v, x, y))
        cv.text(315, 622, "GPUs", _INK, align="center")
    if winner is not None:
        bd = winner.breakdown
        x = 600
        cv.text(x, 44, "winner: %d GPUs" % winner.devices, _INK)
        cv.text(x, 56, winner.layout.describe(), _MUTED)
        cv.text(x, 68, "%s samples/s, MFU %.2f" % (fmt(winner.samples_per_s), winner.mfu),
                _MUTED)
        y = _stacked(cv, x, 92, 330, _TIME_PARTS, bd, "step %.4g s" % winner.step_time_s,
                     lambda v: "%.3g s" % v)
        stages = bd.get("stages") or []
        if stages:
            full = max(stages, key=lambda s: sum(s.get(k, 0.0) for k, _, _ in _MEMORY_PARTS))
            mem = dict(full)
            mem["gradients"] = full["gradients"] * full.get("gradient_copies", 1)
            _stacked(cv, x, y + 20, 330, _MEMORY_PARTS, mem,
                     "memory per device, stage %d: %.3g GiB" % (
                         full["stage"], winner.peak_memory_bytes / GiB),
                     lambda v: "%.3g GiB" % (v / GiB))
    return Chart(cv, out)
