"""Every device-count error of the plan says how to get devices on a machine without GPUs
(issue 33 item 8: `examples/bert_pipeline/run.sh` stopped with "merge stages or add
devices" and nothing said how).  Pure Python: fake clusters, no TF graphs."""
import collections

import pytest

from epl.core.cluster import Cluster
from epl.core.config import Config
from epl.core.layout import LayoutError, PipelineLayout, ReplicaLayout, plan

TG = collections.namedtuple("TG", "kind device_count strategy")

# The ways to get devices, as a user types them.
WAYS = ("cluster.devices_per_worker", "EPL_CLUSTER_DEVICES_PER_WORKER",
        "epl-launch --gpu_per_worker", "--num_workers")


def _cfg(**kv):
    return Config({k.replace("__", "."): v for k, v in kv.items()}, environ={})


def _cluster(devices):
    return Cluster(_cfg(cluster__devices_per_worker=devices), tf_config={}, visible_gpus=0)


CASES = {
    "replica wider than the cluster": lambda: ReplicaLayout(4, 8, 4),
    "replicas do not divide the devices": lambda: ReplicaLayout(6, 4, 6),
    "more stages than devices": lambda: PipelineLayout(1, 2, 4, 1),
    "stages do not divide the devices": lambda: PipelineLayout(3, 2, 4, 3),
    "split wider than the job": lambda: plan(_cluster(4), [TG("split", 8, "s")], _cfg()),
    "split leaves devices idle": lambda: plan(_cluster(3), [TG("split", 2, "s")], _cfg()),
    "split stages do not divide the devices": lambda: plan(
        _cluster(4), [TG("split", 2, "a"), TG("split", 2, "b"), TG("split", 2, "c")],
        _cfg(pipeline__num_micro_batch=2)),
    "split takes every device": lambda: plan(
        _cluster(4), [TG("replicate", 1, "r"), TG("split", 4, "s")], _cfg()),
    "pipeline from a cluster of one device": lambda: plan(
        _cluster(1), [TG("replicate", 1, "a"), TG("replicate", 1, "b")],
        _cfg(pipeline__num_micro_batch=4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_count_error_names_the_ways_to_get_devices(case):
    with pytest.raises(LayoutError) as info:
        CASES[case]()
    text = str(info.value)
    missing = [w for w in WAYS if w not in text]
    assert not missing, "%s: %r does not name %s" % (case, text, missing)


def test_the_hint_is_written_once():
    """One helper writes the hint: the plan's messages do not spell it out each."""
    import inspect

    import epl.core.layout
    source = inspect.getsource(epl.core.layout)
    assert source.count("EPL_CLUSTER_DEVICES_PER_WORKER") == 1, source


def test_a_split_wider_than_the_job_says_how_to_get_devices():
    """epl.split(n) fails while the user builds (tensor_parallel.sharding.split_count)."""
    import tensorflow.compat.v1 as tf
    import epl
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    with pytest.raises(ValueError) as e:
        with epl.split(8):
            tf.layers.dense(tf.ones([4, 8]), 16)
    assert "the split needs 8 devices but the job has 2" in str(e.value)
    for way in WAYS:
        assert way in str(e.value), (way, str(e.value))
