"""Unit tests for ray_elastic.config: validation, MaxText mapping, slice specs."""

from __future__ import annotations

import dataclasses

import pytest
from ray.util import tpu

from ray_elastic.config import CpuSlice, ElasticConfig, GpuSlice, TpuSlice
from ray_elastic.errors import ConfigError, ElasticError


def assert_config_error(setting, **kwargs):
    with pytest.raises(ConfigError) as info:
        ElasticConfig(**kwargs)
    assert info.value.setting == setting
    assert str(info.value).startswith(f"{setting}:")
    return info.value


# ElasticConfig validation -----------------------------------------------------


def test_defaults_are_valid():
    cfg = ElasticConfig()
    assert cfg.num_slices == 2
    assert cfg.policy == "pause"
    assert isinstance(cfg.slice, CpuSlice)
    assert cfg.required_slices == 2


def test_config_error_is_value_error_and_elastic_error():
    err = assert_config_error("num_slices", num_slices=0)
    assert isinstance(err, ValueError)
    assert isinstance(err, ElasticError)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, None])
def test_num_slices_must_be_positive_int(n):
    assert_config_error("num_slices", num_slices=n)


@pytest.mark.parametrize("policy", ["pause", "resize"])
def test_min_slices_above_num_slices(policy):
    err = assert_config_error("min_slices", num_slices=2, policy=policy, min_slices=3)
    assert "3" in str(err)


@pytest.mark.parametrize("m", [0, -1, 1.0])
def test_resize_min_slices_out_of_range(m):
    assert_config_error("min_slices", num_slices=3, policy="resize", min_slices=m)


@pytest.mark.parametrize("t", [-1, -0.001, "10", None])
def test_bad_timeout(t):
    assert_config_error("timeout_s", timeout_s=t)


def test_zero_timeout_ok():
    assert ElasticConfig(timeout_s=0).timeout_s == 0


@pytest.mark.parametrize("policy", ["Pause", "shrink", "", None])
def test_unknown_policy(policy):
    err = assert_config_error("policy", policy=policy)
    assert "pause" in str(err) and "resize" in str(err)


def test_pause_with_fewer_min_slices():
    err = assert_config_error("min_slices", num_slices=4, policy="pause", min_slices=2)
    assert "resize" in str(err)


def test_pause_min_slices_equal_num_ok():
    cfg = ElasticConfig(num_slices=4, policy="pause", min_slices=4)
    assert cfg.required_slices == 4


def test_resize_with_one_slice():
    err = assert_config_error("policy", num_slices=1, policy="resize")
    assert "num_slices" in str(err)


@pytest.mark.parametrize("mode", ["grow", "", "Accumulate", None])
def test_bad_batch_on_resize(mode):
    assert_config_error("batch_on_resize", batch_on_resize=mode)


@pytest.mark.parametrize("mode", ["accumulate", "shrink"])
def test_good_batch_on_resize(mode):
    assert ElasticConfig(batch_on_resize=mode).batch_on_resize == mode


@pytest.mark.parametrize("n", [-1, 1.5, "1"])
def test_bad_snapshot_every(n):
    assert_config_error("snapshot_every", snapshot_every=n)


def test_snapshot_every_zero_ok():
    assert ElasticConfig(snapshot_every=0).snapshot_every == 0


@pytest.mark.parametrize("n", [-1, 0.5])
def test_bad_max_retries(n):
    assert_config_error("max_retries", max_retries=n)


@pytest.mark.parametrize(
    "name", ["step_deadline_floor_s", "step_deadline_factor", "first_step_deadline_s"]
)
@pytest.mark.parametrize("value", [0, -1.0])
def test_bad_step_deadlines(name, value):
    assert_config_error(name, **{name: value})


def test_bad_slice_spec_errors_name_slice_field():
    with pytest.raises(ConfigError) as info:
        ElasticConfig(slice=CpuSlice(hosts=0))
    assert info.value.setting == "slice.hosts"


# required_slices --------------------------------------------------------------


def test_required_slices():
    assert ElasticConfig(num_slices=4, policy="pause").required_slices == 4
    assert ElasticConfig(num_slices=4, policy="resize").required_slices == 1
    assert ElasticConfig(num_slices=4, policy="resize", min_slices=3).required_slices == 3
    assert ElasticConfig(num_slices=4, policy="resize", min_slices=4).required_slices == 4


# from_maxtext -------------------------------------------------------------------


def test_from_maxtext_default_is_pause():
    cfg = ElasticConfig.from_maxtext(num_slices=4)
    assert cfg.policy == "pause"
    assert cfg.min_slices is None
    assert cfg.required_slices == 4
    assert cfg.timeout_s == 300.0
    assert cfg.max_retries == 10


def test_from_maxtext_minus_one_is_pause():
    cfg = ElasticConfig.from_maxtext(num_slices=3, elastic_min_slice_count=-1)
    assert (cfg.policy, cfg.min_slices, cfg.required_slices) == ("pause", None, 3)


def test_from_maxtext_min_equal_num_is_pause():
    cfg = ElasticConfig.from_maxtext(num_slices=3, elastic_min_slice_count=3)
    assert cfg.policy == "pause" and cfg.required_slices == 3


def test_from_maxtext_min_one_is_resize():
    cfg = ElasticConfig.from_maxtext(num_slices=4, elastic_min_slice_count=1)
    assert cfg.policy == "resize"
    assert cfg.min_slices == 1
    assert cfg.required_slices == 1


def test_from_maxtext_maps_timeout_retries_and_rest():
    cfg = ElasticConfig.from_maxtext(
        num_slices=4,
        elastic_timeout_seconds=42.5,
        elastic_max_retries=7,
        elastic_min_slice_count=2,
        snapshot_every=5,
        batch_on_resize="shrink",
        seed=3,
    )
    assert cfg.timeout_s == 42.5
    assert cfg.max_retries == 7
    assert (cfg.policy, cfg.min_slices) == ("resize", 2)
    assert (cfg.snapshot_every, cfg.batch_on_resize, cfg.seed) == (5, "shrink", 3)


def test_from_maxtext_invalid_values_raise_config_error():
    with pytest.raises(ConfigError) as info:
        ElasticConfig.from_maxtext(num_slices=2, elastic_min_slice_count=5)
    assert info.value.setting == "min_slices"
    with pytest.raises(ConfigError) as info:
        ElasticConfig.from_maxtext(num_slices=2, elastic_timeout_seconds=-5)
    assert info.value.setting == "timeout_s"


# frozen -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj,field",
    [
        (ElasticConfig(), "num_slices"),
        (ElasticConfig(), "policy"),
        (CpuSlice(), "hosts"),
        (GpuSlice(), "gpus_per_host"),
        (TpuSlice(), "topology"),
    ],
)
def test_frozen(obj, field):
    before = getattr(obj, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, before)
    assert getattr(obj, field) == before


def test_replace_revalidates():
    cfg = ElasticConfig(num_slices=4, policy="resize", min_slices=2)
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, min_slices=9)


# CpuSlice / GpuSlice ---------------------------------------------------------------


def test_cpu_slice_bundles_and_env():
    s = CpuSlice(hosts=3, cpus_per_host=2, devices_per_host=4)
    assert s.bundles() == [{"CPU": 2.0}] * 3
    b = s.bundles()
    b[0]["CPU"] = 99  # bundles are independent copies
    assert s.bundles()[0] == {"CPU": 2.0}
    env = s.worker_env()
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize("field", ["hosts", "cpus_per_host", "devices_per_host"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_cpu_slice_invalid(field, value):
    with pytest.raises(ConfigError) as info:
        CpuSlice(**{field: value})
    assert info.value.setting == f"slice.{field}"


def test_gpu_slice_bundles_and_env():
    s = GpuSlice(hosts=2, gpus_per_host=8, cpus_per_host=4)
    b = s.bundles()
    assert b == [{"CPU": 4.0, "GPU": 8.0}] * 2
    assert b[0] is not b[1]
    assert s.worker_env() == {"JAX_PLATFORMS": "cuda"}


def test_gpu_slices_can_share_a_gpu_each_with_its_share_of_the_memory():
    half = GpuSlice(gpus_per_host=0.5)
    assert half.bundles() == [{"CPU": 1.0, "GPU": 0.5}] and half.devices == 1 and half.shared
    assert half.worker_env() == {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}
    assert GpuSlice(hosts=2, gpus_per_host=0.25).devices == 2
    assert GpuSlice(gpus_per_host=2.0).devices == 2 and not GpuSlice(gpus_per_host=2.0).shared


@pytest.mark.parametrize("value", [1.5, -0.5, True, "1", 0.0])
def test_a_gpu_share_is_below_one_or_whole(value):
    with pytest.raises(ConfigError, match="share of one GPU") as info:
        GpuSlice(gpus_per_host=value)
    assert info.value.setting == "slice.gpus_per_host"


@pytest.mark.parametrize("field", ["hosts", "gpus_per_host", "cpus_per_host"])
def test_gpu_slice_invalid(field):
    with pytest.raises(ConfigError) as info:
        GpuSlice(**{field: 0})
    assert info.value.setting == f"slice.{field}"


# TpuSlice ------------------------------------------------------------------------


def test_tpu_v6e_4x4():
    s = TpuSlice(topology="4x4", accelerator_version="v6e")
    assert s.hosts == 4
    assert s.bundles() == [{"CPU": 1, "TPU": 4}] * 4
    assert s.worker_env() == {"JAX_PLATFORMS": "tpu"}


@pytest.mark.parametrize(
    "acc,topology",
    [
        ("v6e", "2x2"),
        ("v6e", "1x1"),
        ("v6e", "2x4"),
        ("v6e", "8x8"),
        ("v5p", "2x2x1"),
        ("v5p", "2x2x2"),
        ("v5p", "4x4x4"),
        ("v4", "2x2x2"),
        ("v5litepod", "2x4"),
        ("TPU-V6E", "4x4"),
    ],
)
def test_tpu_topologies_match_ray(acc, topology):
    s = TpuSlice(topology=topology, accelerator_version=acc)
    n, res = tpu.get_tpu_worker_resources(topology=topology, accelerator_type=acc)
    assert s.hosts == n
    assert s.bundles() == [res] * n
    # total chips across the slice match the topology
    chips = 1
    for d in topology.split("x"):
        chips *= int(d)
    assert sum(b["TPU"] for b in s.bundles()) == chips


def test_tpu_known_values():
    assert TpuSlice(topology="2x2x2", accelerator_version="v5p").hosts == 2
    assert TpuSlice(topology="4x4x4", accelerator_version="v5p").hosts == 16
    assert TpuSlice(topology="2x2", accelerator_version="v6e").hosts == 1


def test_tpu_normalises_case_and_whitespace():
    s = TpuSlice(topology=" 4X4 ", accelerator_version=" v6e ")
    assert s.hosts == 4
    assert s.bundles() == [{"CPU": 1, "TPU": 4}] * 4


def test_tpu_chips_per_vm_override():
    s = TpuSlice(topology="4x4", accelerator_version="v6e", chips_per_vm=8)
    assert s.hosts == 2
    assert s.bundles() == [{"CPU": 1, "TPU": 8}] * 2


@pytest.mark.parametrize(
    "acc,topology",
    [("v6e", "3x3"), ("v6e", "2x2x2"), ("v5p", "2x2"), ("v4", "4x4"), ("v6e", "abc"), ("v6e", "")],
)
def test_tpu_invalid_topology(acc, topology):
    with pytest.raises(ConfigError) as info:
        TpuSlice(topology=topology, accelerator_version=acc)
    assert info.value.setting == "slice.topology"
    assert repr(topology) in str(info.value)


@pytest.mark.parametrize("acc", ["v6e-16", "foo", "", "v99"])
def test_tpu_invalid_accelerator(acc):
    with pytest.raises(ConfigError) as info:
        TpuSlice(topology="2x2", accelerator_version=acc)
    assert info.value.setting == "slice.accelerator_version"
    assert str(info.value).startswith("slice.accelerator_version:")


def test_elastic_config_with_tpu_slice():
    cfg = ElasticConfig(num_slices=2, slice=TpuSlice(topology="4x4", accelerator_version="v6e"))
    assert cfg.slice.hosts == 4


def test_batch_shards_default_and_checks():
    assert ElasticConfig(num_slices=3).shards == 3
    assert ElasticConfig(num_slices=1, batch_shards=2).shards == 2
    assert_config_error("batch_shards", num_slices=2, batch_shards=0)
    err = assert_config_error("batch_shards", num_slices=2, policy="resize", batch_on_resize="shrink", batch_shards=4)
    assert "accumulate" in str(err)


def test_workers_get_the_allocator_settings(monkeypatch):
    """Every worker process starts with glibc's large allocations on mmap
    and two arenas (slice_group.MALLOC_ENV); the driver's environment wins."""
    from ray_elastic.cluster.slice_group import MALLOC_ENV, worker_env

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = worker_env(CpuSlice(devices_per_host=2))
    assert {k: env[k] for k in MALLOC_ENV} == {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert worker_env(GpuSlice())["MALLOC_ARENA_MAX"] == "4"
    assert worker_env(GpuSlice())["JAX_PLATFORMS"] == "cuda"
