"""Errors on the command line: a bad setting is one line on stderr,
`ray-elastic: error: SETTING: PROBLEM`, and exit 2, found before any Ray
cluster is started; a run that fails is its message and exit 1; the
traceback only with --debug or RAY_ELASTIC_DEBUG=1. `ray-elastic
checkpoints` on a path that names nothing is an error, on an empty folder
not. No cluster: every demo case here must fail before one would start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ray_elastic.cli import main
from ray_elastic.errors import ConfigError, ReplacementTimeout

pytestmark = pytest.mark.timeout(60)


class _NoCluster:
    def __init__(self, *a, **k):
        raise AssertionError("a Ray cluster was started before the settings were checked")


@pytest.fixture
def no_cluster(monkeypatch):
    """The demo's LocalCluster, made to fail the test if it is started."""
    monkeypatch.setattr("ray_elastic.cluster.local_cluster.LocalCluster", _NoCluster)
    monkeypatch.delenv("RAY_ELASTIC_DEBUG", raising=False)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(err: str, message: str) -> None:
    assert "Traceback" not in err, err
    assert err.strip().splitlines() == [f"ray-elastic: error: {message}"], err


def test_a_bad_setting_is_one_line_and_exit_2(no_cluster, capsys):
    rc, out, err = _run(capsys, "demo", "--slices", "0")
    assert rc == 2
    _one_line_error(err, "num_slices: must be a positive integer, got 0")
    assert "starting a local Ray cluster" not in out


@pytest.mark.parametrize("argv, message", [
    # The mesh fsdp x tensor(2) on 3 devices.
    (["--sharding", "fsdp_tp", "--devices-per-host", "3"], "layout.mesh: data=1 x tensor=2 does not divide the slice's 3"),
    # A fault on a slice the run does not have (slices 0 and 1).
    (["--fail-slice", "2"], "faults: Fault(kind='remove_node', slice_id=2"),
    (["--policy", "resize", "--min-slices", "3"], "min_slices: must be between 1 and num_slices=2, got 3"),
    (["--hosts-per-slice", "0"], "slice.hosts: must be a positive integer, got 0"),
    (["--timeout", "-1"], "timeout_s: must be >= 0 seconds"),
    (["--checkpoint", "gs://", "--save-every", "5"], "checkpoint.path: 'gs://' names no bucket"),
    (["--report", "/no/such/folder/report.json"], "--report: cannot write /no/such/folder/report.json"),
])
def test_demo_settings_fail_before_the_cluster(no_cluster, capsys, argv, message):
    rc, out, err = _run(capsys, "demo", *argv)
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ray-elastic: error: {message}"), err


def test_a_bad_option_value_is_argparses_error(no_cluster, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", "0"])
    assert e.value.code == 2
    assert "argument --steps: must be a positive integer, got 0" in capsys.readouterr().err


def test_debug_prints_the_traceback_too(no_cluster, capsys, monkeypatch):
    for argv in (["--debug", "demo", "--slices", "0"], ["demo", "--slices", "0", "--debug"]):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and "Traceback" in err and "ConfigError" in err, err
        assert err.strip().splitlines()[-1] == "ray-elastic: error: num_slices: must be a positive integer, got 0"
    monkeypatch.setenv("RAY_ELASTIC_DEBUG", "1")
    rc, _, err = _run(capsys, "demo", "--slices", "0")
    assert rc == 2 and "Traceback" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "RAY_ELASTIC_DEBUG=1" in " ".join(capsys.readouterr().out.split())


def test_a_missing_bucket_fails_before_the_cluster(no_cluster, capsys, gcs):
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    rc, _, err = _run(capsys, "demo", "--checkpoint", "gs://no-such-bucket/run")
    assert rc == 2
    _one_line_error(err, "checkpoint.path: bucket gs://no-such-bucket does not exist (or is not visible with "
                         "these credentials). Create it or point checkpoint.path elsewhere.")


def test_an_unreachable_gcs_fails_before_the_cluster(no_cluster, capsys, monkeypatch, gcs_outage_fails_fast):
    import gcsfs

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "test-project")
    gcsfs.GCSFileSystem.clear_instance_cache()
    rc, _, err = _run(capsys, "demo", "--checkpoint", f"gs://bucket-{closed}/run")
    gcsfs.GCSFileSystem.clear_instance_cache()
    assert rc == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ray-elastic: error: checkpoint.path: cannot reach gs://bucket-{closed}"), err


class _FakeCluster:
    logs_dir = "/tmp"
    stopped = False

    def __init__(self, *a, **k):
        pass

    def shutdown(self):
        _FakeCluster.stopped = True


@pytest.mark.parametrize("error, rc, message", [
    (ReplacementTimeout("only 1 of 2 slices came back within 1 s; raise timeout_s", setting="timeout_s"), 1,
     "run failed: only 1 of 2 slices came back within 1 s; raise timeout_s"),
    (ConfigError("faults", "a remove_node fault needs a cluster that can do it"), 2,
     "faults: a remove_node fault needs a cluster that can do it"),
])
def test_an_error_once_the_cluster_is_up_is_its_message(capfd, monkeypatch, error, rc, message):
    """What the run raises (after the cluster started): the message and
    its exit code, the cluster stopped, no traceback."""
    monkeypatch.delenv("RAY_ELASTIC_DEBUG", raising=False)
    monkeypatch.setattr("ray_elastic.cluster.local_cluster.LocalCluster", _FakeCluster)

    def run_demo(*a, **k):
        raise error

    monkeypatch.setattr("ray_elastic.cli.run_demo", run_demo)
    _FakeCluster.stopped = False
    assert main(["demo", "--steps", "4"]) == rc
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"ray-elastic: error: {message}", err
    assert _FakeCluster.stopped


def test_the_console_script_prints_the_message_alone():
    script = os.path.join(os.path.dirname(sys.executable), "ray-elastic")
    if not os.path.exists(script):
        pytest.skip("the ray-elastic console script is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ELASTIC_DEBUG"}
    out = subprocess.run([script, "demo", "--slices", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr == "ray-elastic: error: num_slices: must be a positive integer, got 0\n", out.stderr
    assert out.stdout == ""


# -- ray-elastic checkpoints -------------------------------------------------

def test_checkpoints_of_a_missing_folder_is_an_error(capsys, tmp_path):
    rc, out, err = _run(capsys, "checkpoints", str(tmp_path / "no-such-folder"))
    assert rc == 2 and out == ""
    _one_line_error(err, f"checkpoint.path: {tmp_path / 'no-such-folder'} does not exist")
    (tmp_path / "a-file").write_text("x")
    rc, _, err = _run(capsys, "checkpoints", str(tmp_path / "a-file"))
    assert rc == 2
    _one_line_error(err, f"checkpoint.path: {tmp_path / 'a-file'} is not a folder")


def test_checkpoints_of_an_empty_folder_lists_none(capsys, tmp_path):
    rc, out, err = _run(capsys, "checkpoints", str(tmp_path))
    assert rc == 0 and err == ""
    assert out.strip() == f"no checkpoint steps under {tmp_path}"


def test_checkpoints_on_gcs_a_missing_bucket_is_an_error_a_missing_prefix_is_empty(capsys, gcs):
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    rc, _, err = _run(capsys, "checkpoints", "gs://no-such-bucket/run")
    assert rc == 2
    _one_line_error(err, "checkpoint.path: bucket gs://no-such-bucket does not exist (or is not visible with "
                         "these credentials)")
    # GCS has no folders: a prefix nothing was written under is an empty one.
    rc, out, err = _run(capsys, "checkpoints", "gs://ckpt/never-written")
    assert rc == 0 and err == ""
    assert out.strip() == "no checkpoint steps under gs://ckpt/never-written"
