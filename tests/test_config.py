"""The config schema: keys, types, defaults, env overrides, errors, generated docs."""
import os

import pytest

from epl.core.config import SCHEMA, Config, env_var_name, markdown

SEED_KEYS = {
    "pipeline.num_micro_batch": 1, "pipeline.num_stages": None,
    "pipeline.strategy": "PreferBackward", "gradient_checkpoint.type": "",
    "gradient_checkpoint.end_taskgraph": -1, "gradient_checkpoint.check_gradients": False,
    "zero.level": "", "offload.level": "", "amp.level": "", "amp.debug_log": False,
    "amp.loss_scale": "dynamic", "optimizer.num_apply_group": 1,
    "cluster.device_place_prefer_intra_node": True, "cluster.run_visible_devices": "",
    "cluster.colocate_split_and_replicate": False, "communication.num_communicators": 2,
    "communication.sparse_as_dense": False, "communication.max_splits": 5,
    "communication.fp16": False, "communication.fp16_scale": 128,
    "communication.clip_after_allreduce": False,
    "communication.gradients_reduce_method": "mean", "io.slicing": False,
    "io.unbalanced_io_slicing": False, "io.drop_last_files": False,
    "auto.auto_parallel": False,
}


def test_all_26_seed_keys_with_defaults():
    assert len(SEED_KEYS) == 26
    cfg = Config(environ={})
    for key, default in SEED_KEYS.items():
        assert cfg.get(key) == default, key
    extensions = {k.name for k in SCHEMA} - set(SEED_KEYS)
    assert extensions == {"cluster.device_type", "cluster.devices_per_worker", "cluster.variable_copies",
                          "cluster.keep_freed_host_memory",
                          "communication.timeout_seconds", "amp.dtype",
                          "profile.dir", "profile.steps", "profile.runs"}


def test_attribute_access_and_dict():
    cfg = Config({"pipeline.num_micro_batch": 4}, environ={})
    assert cfg.pipeline.num_micro_batch == 4
    assert cfg.communication.max_splits == 5
    assert "num_micro_batch" in repr(cfg)


def test_env_override_and_dict_wins():
    env = {"EPL_PIPELINE_NUM_MICRO_BATCH": "8", "EPL_COMMUNICATION_FP16": "true",
           "EPL_AMP_LOSS_SCALE": "128"}
    cfg = Config(environ=env)
    assert cfg.get("pipeline.num_micro_batch") == 8
    assert cfg.get("communication.fp16") is True
    assert cfg.get("amp.loss_scale") == 128
    cfg = Config({"pipeline.num_micro_batch": 2}, environ=env)
    assert cfg.get("pipeline.num_micro_batch") == 2


def test_env_var_names():
    assert env_var_name("pipeline.num_micro_batch") == "EPL_PIPELINE_NUM_MICRO_BATCH"


@pytest.mark.parametrize("bad, match", [
    ({"pipeline.num_micro_batches": 2}, r"unknown key 'pipeline.num_micro_batches'.*"
                                        r"Did you mean 'pipeline.num_micro_batch'"),
    ({"pipelin.num_micro_batch": 2}, r"unknown section 'pipelin'"),
    ({"pipeline.num_micro_batch": "4"}, r"'pipeline.num_micro_batch' = '4' is invalid.*integer"),
    ({"pipeline.num_micro_batch": True}, r"'pipeline.num_micro_batch'"),
    ({"communication.fp16": 1}, r"'communication.fp16' = 1 is invalid.*bool"),
    ({"pipeline.strategy": "GPipe"}, r"'PreferBackward', 'PreferForward'"),
    ({"gradient_checkpoint.type": "manual"}, r"'collection', 'auto'"),
    ({"zero.level": "v2"}, r"'zero.level' = 'v2'.*'v1'"),
    ({"offload.level": "v1"}, r"'offload.level'.*'v0'"),
    ({"amp.level": "O2"}, r"'amp.level'.*'O1'"),
    ({"communication.gradients_reduce_method": "avg"}, r"'mean', 'sum'"),
    ({"amp.loss_scale": "static"}, r"'amp.loss_scale' = 'static'.*'dynamic' or a positive"),
    ({"amp.loss_scale": -1}, r"must be positive"),
])
def test_bad_values_name_key_and_allowed(bad, match):
    with pytest.raises(ValueError, match=match):
        Config(bad, environ={})


def test_bad_env_value_names_variable():
    with pytest.raises(ValueError, match="EPL_PIPELINE_NUM_MICRO_BATCH"):
        Config(environ={"EPL_PIPELINE_NUM_MICRO_BATCH": "four"})


def test_loss_scale_number_or_dynamic():
    assert Config({"amp.loss_scale": 128}, environ={}).get("amp.loss_scale") == 128
    assert Config({"amp.loss_scale": 0.5}, environ={}).get("amp.loss_scale") == 0.5
    assert Config({"amp.loss_scale": "dynamic"}, environ={}).get("amp.loss_scale") == "dynamic"


def test_docs_match_schema():
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "config.md")
    with open(path) as f:
        assert f.read() == markdown(), "docs/config.md is stale: run `make docs`"
