"""The picture of one traced step (``profile.png``): a lane per device over the step
(compute, bytes moving, waiting for peers; under it the pipeline stages' micro-batch
forwards and backwards), then a stacked bar per device (compute, exposed communication,
exposed waiting, idle as shares of the step).

The image is ``image_size(number of devices)`` pixels: WIDTH wide, a fixed head and
foot plus LANE_H + BAR_H rows per device.
"""
import os

from epl.profile import analysis
from epl.profile.png import Canvas

WIDTH = 1200
HEAD, AXIS, GAP, FOOT = 40, 24, 30, 40
LANE_H, BAR_H = 36, 24
LABEL_W = 290
RIGHT = 20

COMPUTE = (66, 133, 244)
COMM = (251, 140, 0)
WAIT = (229, 57, 53)
IDLE = (224, 224, 224)
FORWARD = (67, 160, 71)
BACKWARD = (142, 36, 170)
INK = (33, 33, 33)


def image_size(devices):
    """(width, height) of the picture of a step run on ``devices`` device lanes."""
    return WIDTH, HEAD + devices * LANE_H + AXIS + GAP + devices * BAR_H + FOOT


def _lanes(traces):
    out = []
    for t in traces:
        for name, lane in t.lanes.items():
            out.append((name, lane))
    return out


def render(traces, title):
    """A Canvas of one step (``traces``: every worker's trace of it)."""
    lanes = _lanes(traces)
    micro = max(int(t.meta.get("num_micro_batch", 1)) for t in traces)
    rows = analysis.breakdown(traces)
    width, height = image_size(len(lanes))
    c = Canvas(width, height)
    lo, hi = analysis.step_window(traces)
    span = float(max(hi - lo, 1))
    x0, x1 = LABEL_W, width - RIGHT

    def x(t):
        return x0 + (t - lo) / span * (x1 - x0)

    c.text(10, 12, "EPL %s: %d worker(s), %.2f ms" % (title, len(traces), span / 1e3),
           INK, 2)
    y = HEAD
    for name, lane in lanes:
        c.text(10, y + 8, name, INK, 2)
        c.rect(x0, y, x1, y + 20, IDLE)
        compute, comm, wait = analysis.lane_intervals(lane)
        for spans, color in ((wait, WAIT), (compute, COMPUTE), (comm, COMM)):
            for a, b in spans:
                c.rect(x(a), y, max(x(b), x(a) + 1), y + 20, color)
        for e in lane["stages"]:
            a, b = x(e["ts"]), x(e["ts"] + e["dur"])
            color = FORWARD if e["args"]["phase"] == "forward" else BACKWARD
            c.rect(a, y + 22, max(b, a + 1), y + 32, color)
            label = str(e["args"]["micro_batch"])
            if micro > 1 and b - a > 8 * len(label):   # (the micro-batch, in a pipeline)
                c.text(a + 2, y + 23, label, (255, 255, 255))
        y += LANE_H
    for k in range(5):   # time axis
        t = lo + span * k / 4
        c.rect(x(t), y, x(t) + 1, y + 5, INK)
        label = "%.1f ms" % ((t - lo) / 1e3)
        c.text(min(x(t), x1 - 6 * len(label)), y + 8, label, INK)
    y += AXIS + GAP
    c.text(10, y - 22, "share of the step per device", INK, 2)
    for row in rows:
        c.text(10, y + 4, row.name, INK, 2)
        at = x0
        for part, color in ((row.compute_us, COMPUTE), (row.exposed_us, COMM),
                            (row.wait_us, WAIT), (row.idle_us, IDLE)):
            w = (x1 - x0) * part / span
            c.rect(at, y, at + w, y + 18, color)
            pct = "%.0f%%" % (100.0 * part / span)
            if w > 6 * len(pct) + 4:
                c.text(at + 2, y + 6, pct, INK if color == IDLE else (255, 255, 255))
            at += w
        y += BAR_H
    y += 12
    at = 10
    for label, color in (("compute", COMPUTE), ("communication", COMM),
                         ("waiting for peers", WAIT), ("idle", IDLE),
                         ("forward", FORWARD), ("backward", BACKWARD)):
        c.rect(at, y, at + 16, y + 16, color)
        at = c.text(at + 22, y + 1, label, INK, 2) + 24
    return c


def render_folder(folder, step=None, path=None, graph=1):
    """Render ``step`` of ``graph`` (default: the last traced) of ``folder``'s traces to
    ``path`` (default ``folder/profile.png``); returns the path."""
    steps = analysis.load(folder)
    key = max(steps) if step is None else (graph, step)
    if key not in steps:
        raise ValueError("no trace of %s in %r (traced: %s)" % (
            analysis.label(key), folder, ", ".join(analysis.label(k) for k in sorted(steps))))
    path = path or os.path.join(folder, "profile.png")
    render(steps[key], analysis.label(key)).save(path)
    return path
