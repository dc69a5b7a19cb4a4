"""Cluster from TF_CONFIG and the pure-Python layout plan (no TF graphs)."""
import collections

import pytest

from epl.core.cluster import Cluster
from epl.core.config import Config
from epl.core.layout import LayoutError, ReplicaLayout, plan


def _cfg(**kv):
    return Config({k.replace("__", "."): v for k, v in kv.items()}, environ={})


def test_no_tf_config_is_one_local_worker():
    c = Cluster(_cfg(cluster__devices_per_worker=4), tf_config={}, visible_gpus=0)
    assert (c.worker_num, c.worker_index, c.gpu_num_per_worker, c.total_gpu_num) == (1, 0, 4, 4)
    assert c.device_type == "cpu" and c.is_chief
    assert c.device(3) == "/job:localhost/replica:0/task:0/device:CPU:3"


def test_workers_and_chief():
    tf_config = {"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"], "ps": ["p:1"]},
                 "task": {"type": "worker", "index": 1}}
    c = Cluster(_cfg(cluster__devices_per_worker=2), tf_config=tf_config, visible_gpus=0)
    assert c.worker_num == 3            # chief + 2 workers train; ps does not
    assert c.worker_index == 2          # chief is worker 0
    assert c.total_gpu_num == 6 and not c.is_chief
    assert c.ps_hosts == ["p:1"]
    assert c.device(0) == "/job:chief/replica:0/task:0/device:CPU:0"
    assert c.device(5) == "/job:worker/replica:0/task:1/device:CPU:1"
    assert c.local_devices == ["/job:worker/replica:0/task:1/device:CPU:0",
                               "/job:worker/replica:0/task:1/device:CPU:1"]


def test_ps_task_trains_nothing():
    tf_config = {"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}
    c = Cluster(_cfg(), tf_config=tf_config, visible_gpus=0)
    assert c.worker_index == -1 and c.worker_num == 1


def test_only_workers():
    tf_config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
    c = Cluster(_cfg(), tf_config=tf_config, visible_gpus=0)
    assert c.worker_num == 2 and c.is_chief and c.total_gpu_num == 2


def test_gpus_and_visible_devices():
    c = Cluster(_cfg(cluster__run_visible_devices="1,3"), tf_config={}, visible_gpus=4)
    assert c.device_type == "gpu" and c.gpu_num_per_worker == 2
    assert c.device(1).endswith("/device:GPU:1")


def test_gpu_requested_but_none():
    with pytest.raises(ValueError, match="no GPU is visible"):
        Cluster(_cfg(cluster__device_type="gpu"), tf_config={}, visible_gpus=0)


def test_bad_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        Cluster(_cfg())


TG = collections.namedtuple("TG", "kind device_count strategy")


def test_layout_infers_replicas():
    lay = ReplicaLayout(8, 1, 4)
    assert lay.num_replicas == 8 and lay.num_clones == 8
    lay = ReplicaLayout(8, 2, 4)
    assert lay.num_replicas == 4 and lay.devices[1] == [2, 3]


def test_layout_prefer_inter_node_spreads_replica():
    lay = ReplicaLayout(8, 2, 4, prefer_intra_node=False)
    assert lay.devices[0] == [0, 4] and lay.devices[3] == [3, 7]


def test_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match=r"6 devices cannot be divided.*of 4 devices.*6 % 4 = 2"):
        ReplicaLayout(6, 4, 6)
    with pytest.raises(LayoutError, match=r"needs 8 devices per model replica.*only 4"):
        ReplicaLayout(4, 8, 4)


def test_plan_from_cluster():
    c = Cluster(_cfg(cluster__devices_per_worker=4), tf_config={}, visible_gpus=0)
    lay = plan(c, [TG("replicate", 2, "epl.replicate(2)")], _cfg())
    assert lay.num_replicas == 2
    assert plan(c, [], _cfg()) is None


def test_plan_split_layouts():
    c = Cluster(_cfg(cluster__devices_per_worker=4), tf_config={}, visible_gpus=0)
    split4 = TG("split", 4, "epl.split(4)")
    whole = plan(c, [split4], _cfg())
    assert whole.split_devices == {split4: [0, 1, 2, 3]} and whole.num_clones == 1
    rep, head = TG("replicate", 1, "epl.replicate(1)"), TG("split", 2, "epl.split(2)")
    apart = plan(c, [rep, head], _cfg())
    assert apart.num_replicas == 2 and apart.split_devices == {head: [2, 3]}
    together = plan(c, [rep, head], _cfg(cluster__colocate_split_and_replicate=True))
    assert together.num_replicas == 4 and together.split_devices == {head: [0, 1]}


def test_plan_split_errors_name_the_fix():
    c = Cluster(_cfg(cluster__devices_per_worker=4), tf_config={}, visible_gpus=0)
    with pytest.raises(LayoutError, match=r"needs 8 devices but the job has 4"):
        plan(c, [TG("split", 8, "epl.split(8)")], _cfg())
    with pytest.raises(LayoutError, match=r"6 devices cannot be divided into split groups of 4"):
        plan(Cluster(_cfg(cluster__devices_per_worker=6), tf_config={}, visible_gpus=0),
             [TG("split", 4, "epl.split(4)")], _cfg())
    with pytest.raises(LayoutError, match=r"takes all 4 devices.*colocate_split_and_replicate"):
        plan(c, [TG("replicate", 1, "r"), TG("split", 4, "s")], _cfg())
    with pytest.raises(NotImplementedError, match="pipelines of split and replicate scopes"):
        plan(c, [TG("replicate", 1, "r"), TG("split", 2, "s")],
             _cfg(pipeline__num_micro_batch=2))
    with pytest.raises(LayoutError, match=r"3 pipeline stages of .* 4 devices cannot be "
                                          r"divided into split groups of 6"):
        plan(c, [TG("split", 2, "s")] * 3, _cfg(pipeline__num_micro_batch=2))


def test_plan_split_groups():
    """Split scopes alone over part of the devices: data-parallel groups, each split over
    its own consecutive devices; shard j of every group is lane j of its clone."""
    c = Cluster(_cfg(cluster__devices_per_worker=8), tf_config={}, visible_gpus=0)
    a, b = TG("split", 2, "epl.split(2)"), TG("split", 2, "epl.split(2)")
    lay = plan(c, [a, b], _cfg())
    assert lay.split_groups and lay.num_clones == 4 and lay.lanes == 2
    assert lay.devices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [lay.stage_device(g, 1) for g in range(4)] == [1, 3, 5, 7]
    assert lay.split_devices == {a: [0, 1], b: [0, 1]}    # the user's ops: group 0
    # With micro-batches every split scope is a stage: 2 stages x 2 shards per group.
    pipe = plan(c, [a, b], _cfg(pipeline__num_micro_batch=3))
    assert (pipe.num_stages, pipe.num_replicas, pipe.lanes, pipe.num_clones) == (2, 2, 4, 6)
    assert pipe.devices == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [pipe.representative(g) for g in range(6)] == [0, 0, 0, 3, 3, 3]
    accumulate = plan(c, [TG("split", 8, "s8")], _cfg(pipeline__num_micro_batch=2))
    assert (accumulate.num_stages, accumulate.num_clones, accumulate.lanes) == (1, 2, 8)
    # (splits of different sizes are not groups: the old refusal names them)
    with pytest.raises(LayoutError, match=r"uses 4 devices but this job has 8"):
        plan(c, [TG("split", 2, "s2"), TG("split", 4, "s4")], _cfg())


def test_plan_split_across_workers_runs_in_graph():
    from epl.core.layout import spans_workers
    two = Cluster(_cfg(cluster__devices_per_worker=2),
                  tf_config={"cluster": {"worker": ["a:1", "b:1"]},
                             "task": {"type": "worker", "index": 0}}, visible_gpus=0)
    split4 = TG("split", 4, "s")
    lay = plan(two, [split4], _cfg())
    assert lay.split_devices == {split4: [0, 1, 2, 3]} and spans_workers(lay, 2)
    dp = plan(two, [TG("replicate", 1, "r")], _cfg())
    assert not spans_workers(dp, 2)     # plain DP stays between-graph
    groups = plan(two, [TG("split", 2, "s")], _cfg())
    assert groups.split_groups and not spans_workers(groups, 2)   # a group per worker


def test_zero_across_workers_runs_in_graph():
    """zero.level over several workers: one copy of the state in the job (in-graph);
    plain DP and ZeRO on one worker stay as they were."""
    from epl.core.layout import in_graph
    two = Cluster(_cfg(cluster__devices_per_worker=2),
                  tf_config={"cluster": {"worker": ["a:1", "b:1"]},
                             "task": {"type": "worker", "index": 0}}, visible_gpus=0)
    one = Cluster(_cfg(cluster__devices_per_worker=2), tf_config={}, visible_gpus=0)
    dp = [TG("replicate", 1, "r")]
    zero = _cfg(zero__level="v1")
    assert in_graph(plan(two, dp, zero), two, zero)
    assert not in_graph(plan(two, dp, _cfg()), two, _cfg())
    assert not in_graph(plan(one, dp, zero), one, zero)
