"""The executor's costs ``local_step.timed`` hands the replay (epl/auto/local_step.py).

The hand-off: what a one-thread kernel's lone run costs beyond its chain, which every
kernel's wake-up is measured net of.  Stop 61 (AMD EPYC): one 16 x 16 product's probe
(``HANDOFF``) read 0-20 us from model to model in one run (19.6 us for the mini-BERT in
both rounds, whose rows then read 15-25 % fast), while the median over each model's
one-thread kernels read 5.4-6.7 us for every model.
"""
import json

from epl.auto import local_step, product_timing


def _kernel(i, alone, first):
    return json.dumps(["kernel", "K%d" % i, "", []]), {
        "alone": alone, "shared": alone, "first": first, "first_shared": first}


def test_the_hand_off_is_the_median_over_the_one_thread_kernels():
    timings = dict(_kernel(i, 0.5e-6, 0.5e-6 + d)
                   for i, d in enumerate((5e-6, 6e-6, 7e-6, 6.5e-6, 5.5e-6, 40e-6)))
    wide = dict([_kernel(99, 80e-6, 300e-6)])            # many threads: not counted
    probe = {product_timing.HANDOFF: {"alone": 0.7e-6, "first": 20.3e-6}}
    update = {json.dumps(["update", "ApplyAdam", "x"]): {"alone": 0.2e-6, "first": 90e-6}}
    got = local_step.handoff_seconds(dict(timings, **dict(wide, **dict(probe, **update))))
    assert abs(got - 6.5e-6) < 1e-12


def test_too_few_one_thread_kernels_fall_back_to_the_probe():
    timings = dict(_kernel(i, 0.5e-6, 6e-6) for i in range(local_step.ONE_THREAD_LEAST - 1))
    timings[product_timing.HANDOFF] = {"alone": 1.5e-6, "first": 31.5e-6}
    assert abs(local_step.handoff_seconds(timings) - 30e-6) < 1e-12
    assert local_step.handoff_seconds({}) == 0.0
