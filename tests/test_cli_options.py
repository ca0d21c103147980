"""`ray-elastic demo` and the job driver `examples/train_lm.py` share their
common options (cli_options.py): the same names, defaults and help, the
same example program from them, and help with a default on every option
of both. No cluster."""

from __future__ import annotations

import argparse

import pytest

from ray_elastic.cli import build_parser
from ray_elastic.cli_options import add_shared_options, check_devices_option, example_program
from ray_elastic.config import CpuSlice, GpuSlice, TpuSlice
from ray_elastic.errors import ConfigError

# The defaults each program passes for its own runs.
OWN_DEFAULTS = {"steps": (400, 500), "timeout": (120.0, 300.0)}


def _demo_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["demo"]


def _job_parser() -> argparse.ArgumentParser:
    from examples import train_lm

    return train_lm.build_parser()


def _options(parser: argparse.ArgumentParser) -> dict:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _shared() -> set:
    p = argparse.ArgumentParser()
    add_shared_options(p, steps=1, timeout_s=1.0)
    return set(_options(p))


def test_both_parsers_have_the_shared_options_alike():
    demo, job = _options(_demo_parser()), _options(_job_parser())
    shared = _shared()
    assert {"--model", "--sharding", "--devices-per-host", "--spare-slices", "--slices", "--policy",
            "--checkpoint"} <= shared
    assert shared <= set(demo) and shared <= set(job)
    for name in sorted(shared):
        a, b = demo[name], job[name]
        assert (a.dest, a.help, a.choices, a.type, a.nargs) == (b.dest, b.help, b.choices, b.type, b.nargs), name
        if a.dest in OWN_DEFAULTS:
            assert (a.default, b.default) == OWN_DEFAULTS[a.dest], name
        else:
            assert a.default == b.default, name


@pytest.mark.parametrize("parser", [_demo_parser, _job_parser, build_parser])
def test_every_option_says_what_it_does_and_its_default(parser):
    for name, action in _options(parser()).items():
        assert action.help and len(action.help) > 15, name
        assert "default" in action.help, f"{name}: its help shows no default"
        assert "\n" not in action.help, name


def test_the_job_driver_parses_what_the_demo_parses():
    from examples import train_lm

    argv = ["--slices", "3", "--model", "medium", "--sharding", "fsdp", "--devices-per-host", "2",
            "--spare-slices", "1", "--hang-floor", "20", "--min-slices", "2", "--log-every", "10"]
    job, demo = train_lm.parse(argv), build_parser().parse_args(["demo", *argv])
    for name in ("slices", "model", "sharding", "devices_per_host", "spare_slices", "hang_floor", "min_slices",
                 "log_every"):
        assert getattr(job, name) == getattr(demo, name), name
    spec = train_lm.slice_spec(job)
    assert spec == CpuSlice(hosts=1, cpus_per_host=1, devices_per_host=2)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"model": "small", "sharding": "replicated", "devices_per_host": 1, **kw})


def test_the_example_program_is_checked_against_the_slice():
    import examples.lm as lm

    program = example_program(lm, _args(sharding="fsdp"), CpuSlice(hosts=2, devices_per_host=2))
    assert program.plan.axis_names == ("data", "fsdp", "tensor") and program.plan.axis_sizes == (1, 4, 1)
    assert program.describe() == "the example LM, model small, layout fsdp (mesh data=1 x fsdp=4 x tensor=1 over 4 devices per slice)"
    assert program.factory().layout.sharded
    medium = example_program(lm, _args(model="medium"), CpuSlice())
    assert medium.describe() == "the example LM, model medium, layout replicated (mesh data=1 over 1 device per slice)"
    assert medium.factory.args[0] == lm.PRESETS["medium"] and not medium.layout.sharded
    with pytest.raises(ConfigError, match="layout.mesh"):
        example_program(lm, _args(sharding="fsdp_tp"), CpuSlice(devices_per_host=3))
    # A TPU slice's devices are its chips, from Ray's tables.
    tpu = example_program(lm, _args(sharding="fsdp_tp"), TpuSlice(topology="4x4", accelerator_version="v6e"))
    assert tpu.devices == 16 and tpu.plan.axis_sizes == (1, 8, 2)


def test_devices_per_host_is_for_cpu_slices():
    check_devices_option(_args(devices_per_host=4), CpuSlice(devices_per_host=4))
    check_devices_option(_args(), GpuSlice(gpus_per_host=4))
    with pytest.raises(ConfigError, match="slice.devices_per_host: applies to CPU slices only"):
        check_devices_option(_args(devices_per_host=2), GpuSlice(gpus_per_host=4))
    assert GpuSlice(hosts=2, gpus_per_host=4).devices == 8 and CpuSlice(hosts=3, devices_per_host=2).devices == 6


def test_faults_are_checked_against_the_run():
    from ray_elastic.failures.faults import Fault, check_faults

    check_faults((Fault("kill", 1, 5, host=1),), num_slices=2, hosts_per_slice=2)
    with pytest.raises(ConfigError, match=r"faults: .* names slice 2, but num_slices=2"):
        check_faults((Fault("kill", 2, 5),), num_slices=2, hosts_per_slice=1)
    with pytest.raises(ConfigError, match=r"faults: .* names host 1, but a slice has 1 host \(hosts 0 to 0\)"):
        check_faults((Fault("kill", 0, 5, host=1),), num_slices=2, hosts_per_slice=1)


def test_the_job_driver_reports_a_bad_setting_as_one_line(capsys, monkeypatch):
    from examples import train_lm

    monkeypatch.delenv("RAY_ELASTIC_DEBUG", raising=False)
    monkeypatch.setattr("ray.init", lambda *a, **k: pytest.fail("ray.init before the settings were checked"))
    for argv, message in (
        (["--slices", "0"], "num_slices: must be a positive integer, got 0"),
        (["--fault", "kill:2:5"], "faults: Fault(kind='kill', slice_id=2"),
        (["--sharding", "fsdp_tp", "--devices-per-host", "3"], "layout.mesh: data=1 x tensor=2 does not divide"),
        (["--gpus-per-host", "1", "--devices-per-host", "2"], "slice.devices_per_host: applies to CPU slices only"),
    ):
        assert train_lm.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith(f"train_lm.py: error: {message}"), err


def test_the_example_option_picks_the_program():
    """--example lm-tokens and cnn build the step-contract examples; the
    CNN refuses the LM-only options before anything starts."""
    import examples.lm as lm

    tokens = example_program(lm, _args(example="lm-tokens", sharding="fsdp"), CpuSlice(hosts=2))
    program = tokens.factory()
    assert program.takes_context and program.eval_every > 0 and program.layout.sharded
    assert set(program.aux) == {"accuracy", "z_loss", "tokens"}
    assert tokens.describe().startswith("the token-weighted example LM, model small")
    cnn = example_program(lm, _args(example="cnn"), CpuSlice())
    assert cnn.factory().has_model_state and cnn.describe().startswith("the example CNN")
    with pytest.raises(ConfigError, match="--sharding"):
        example_program(lm, _args(example="cnn", sharding="fsdp"), CpuSlice(devices_per_host=2))
    with pytest.raises(ConfigError, match="--model"):
        example_program(lm, _args(example="cnn", model="large"), CpuSlice())
