"""Streaming DiLoCo's pure parts: its flags' validation, the schedule of
fragments (dispatch/outer_spec.py), the cut of the params into
fragments, and the rounds' boundaries. The runs themselves are in
test_streaming_diloco_e2e.py."""

from __future__ import annotations

import functools

import pytest

from ray_elastic import CpuSlice, ElasticConfig
from ray_elastic.control.diloco import Rounds
from ray_elastic.control.preflight import check_fragments
from ray_elastic.dispatch.outer_spec import OuterSpec, fragment_leaves
from ray_elastic.errors import ConfigError


def _streaming(**kw) -> ElasticConfig:
    return ElasticConfig(**{"enable_diloco": True, "enable_streaming_diloco": True, **kw})


def test_maxtext_names_and_defaults():
    c = _streaming()
    assert (c.num_diloco_fragments, c.num_communication_overlapping_steps, c.communication_overlapping_alpha) == (4, 0, 0.0)
    assert c.diloco_fragment_every == 9  # round(36 / 4)
    assert OuterSpec.of(c) == OuterSpec(0.3, 0.9, 4, 9, 0, 0.0)
    assert not OuterSpec.of(ElasticConfig(enable_diloco=True)).streaming


@pytest.mark.parametrize("kw, setting", [
    ({"enable_streaming_diloco": 1}, "enable_streaming_diloco"),
    ({"num_diloco_fragments": 0}, "num_diloco_fragments"),
    ({"num_communication_overlapping_steps": -1}, "num_communication_overlapping_steps"),
    ({"num_communication_overlapping_steps": 1.5}, "num_communication_overlapping_steps"),
    ({"communication_overlapping_alpha": 1.0}, "communication_overlapping_alpha"),
    ({"communication_overlapping_alpha": -0.1}, "communication_overlapping_alpha"),
    # A fragment's new global params must arrive before it synchronizes again (every 4 x 9 = 36 steps).
    ({"num_communication_overlapping_steps": 36}, "num_communication_overlapping_steps"),
])
def test_bad_flags_name_the_setting(kw, setting):
    with pytest.raises(ConfigError) as e:
        _streaming(**kw)
    assert e.value.setting == setting


def test_streaming_needs_diloco():
    with pytest.raises(ConfigError) as e:
        ElasticConfig(enable_streaming_diloco=True)
    assert e.value.setting == "enable_streaming_diloco" and "enable_diloco=True" in str(e.value)
    # An overlap as long as the whole cycle is fine where it fits: 35 < 36.
    assert _streaming(num_communication_overlapping_steps=35).num_communication_overlapping_steps == 35


def test_fragments_synchronize_in_maxtext_s_order():
    spec = OuterSpec(0.3, 0.9, fragments=4, every=9, overlap=2)
    synced = {k: spec.synced_after(k) for k in range(80) if spec.synced_after(k) is not None}
    assert synced == {9: 1, 18: 2, 27: 3, 36: 0, 45: 1, 54: 2, 63: 3, 72: 0}
    mixed = {k: spec.mixed_before(k) for k in range(80) if spec.mixed_before(k) is not None}
    assert mixed == {k + 2: f for k, f in synced.items() if k + 2 < 80}
    assert OuterSpec(0.3, 0.9, fragments=4, every=9).mixed_before(9) is None  # no overlap: at the synchronization
    assert OuterSpec(0.3, 0.9).synced_after(36) is None  # plain DiLoCo: the rounds say (control/diloco.py)


def test_fragments_are_runs_of_whole_leaves_of_about_equal_bytes():
    assert fragment_leaves([4, 4, 4, 4], 2) == ((0, 1), (2, 3))
    assert fragment_leaves([100, 1, 1, 1], 2) == ((0,), (1, 2, 3))
    assert fragment_leaves([1, 1, 1, 100], 2) == ((0, 1, 2), (3,))
    assert fragment_leaves([7], 1) == ((0,),)
    sizes = [3, 50, 2, 2, 8, 40, 1, 9, 9, 30]
    for n in range(1, len(sizes) + 1):
        frags = fragment_leaves(sizes, n)
        assert len(frags) == n and all(frags)
        assert [i for f in frags for i in f] == list(range(len(sizes)))  # every leaf once, in order
    with pytest.raises(ValueError, match="num_diloco_fragments"):
        fragment_leaves([1, 2], 3)


def test_too_many_fragments_for_the_params_are_refused_before_any_slice():
    import examples.lm as lm

    program = functools.partial(lm.make_program, lm.LMConfig())()
    check_fragments(program, _streaming(num_diloco_fragments=4))
    with pytest.raises(ConfigError) as e:
        check_fragments(program, _streaming(num_diloco_fragments=10_000))
    assert e.value.setting == "num_diloco_fragments" and "at most" in str(e.value)


def test_rounds_start_at_every_fragment_s_synchronization():
    r = Rounds(_streaming(diloco_sync_period=8, num_diloco_fragments=4), steps=11)
    assert [k for k in range(12) if r.boundary(k)] == [2, 4, 6, 8, 10, 11]
    resize = Rounds(_streaming(diloco_sync_period=8, num_diloco_fragments=4, policy="resize"), steps=11)
    resize.round_start = 6
    assert [resize.may_join(k) for k in (6, 7)] == [True, False]


def test_the_demo_and_job_driver_option():
    from ray_elastic.cli import build_parser
    from ray_elastic.cli_options import elastic_config

    config = elastic_config(build_parser().parse_args(["demo", "--diloco", "36", "--diloco-fragments", "4"]), CpuSlice())
    assert config.enable_streaming_diloco and config.num_diloco_fragments == 4 and config.diloco_sync_period == 36
    with pytest.raises(ConfigError) as e:
        elastic_config(build_parser().parse_args(["demo", "--diloco-fragments", "4"]), CpuSlice())
    assert e.value.setting == "enable_streaming_diloco"


def test_progress_lines_name_the_fragment():
    import io

    from ray_elastic.observe.progress import ProgressCallback

    stream = io.StringIO()
    p = ProgressCallback(12, stream=stream)
    p.on_event({"t": 1.0, "event": "diloco_sync", "step": 9, "replicas": [0, 1], "slices": [0, 1],
                "bytes_across_slices": 223090, "fragment": 1})
    assert "step 9: DiLoCo replicas [0, 1] synchronized fragment 1, 0.22 MB across slices" in stream.getvalue()
