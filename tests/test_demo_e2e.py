"""`ray-elastic demo`'s run on a real local cluster: what a new user runs
first and reads figures from must show the trainer's own figures."""

from __future__ import annotations

import io
import json
import types

import pytest

pytestmark = pytest.mark.cluster


def test_the_replacement_node_starts_outside_the_controller_thread(cluster, nodes, tmp_path):
    """Pause with a ready spare, a node removed: the spare joins and the
    step in flight is finished (nothing redone); the replacement node is
    added by the demo's main thread, not the controller's. The controller
    needed no node: the slice that joined is the spare."""
    import examples.lm as lm

    from ray_elastic import CpuSlice, Fault
    from ray_elastic.cli import build_parser, run_demo
    from ray_elastic.cli_options import elastic_config, example_program

    nodes(3)
    report_path = str(tmp_path / "run.json")
    args = build_parser().parse_args(["demo", "--policy", "pause", "--spare-slices", "1", "--fault", "remove_node",
                                      "--steps", "40", "--fail-at", "10", "--report", report_path])
    spec = CpuSlice(hosts=1, devices_per_host=1)
    config = elastic_config(args, spec)
    program = example_program(lm, args, spec)
    console = types.SimpleNamespace(out=io.StringIO(), err=io.StringIO())
    node_starts: list = []
    rc = run_demo(args, cluster, config, None, (Fault("remove_node", 1, 10),), program.factory, console, node_starts)
    assert rc == 0, console.err.getvalue()
    with open(report_path) as fh:
        report = json.load(fh)
    assert len(report["failures"]) == 1, report["failures"]  # the node loss, and no false alarm
    (f,) = report["failures"]
    assert f["kind"] in ("node_died", "process_died") and f["steps_rewound"] == 0 and f["compute_redone"] in (0.0, 0.5)
    events = {e["event"]: e for e in report["events"]}
    assert events["grow"]["joined"] == [2] and "a replacement node is starting" in console.out.getvalue()
    (node,) = node_starts  # one replacement node, for the one lost
    assert node["thread"] != node["controller"]  # added by another thread than the controller's
    # The slice that joined is the spare started before the fault, not one
    # placed on the new node: the controller needed no node. (When it was
    # ready is a race on a busy machine: its set-up can end after the
    # fault, as can a node's start-up, so only its start is compared.)
    spare_ready = next(e for e in report["events"] if e["event"] == "slice_ready" and e["slice"] == 2)
    started = spare_ready["t"] - spare_ready["setup_s"]
    assert events["reserve"]["spares"] == 1 and started < events["fault"]["t"], spare_ready
    assert events["grow"]["t"] > events["fault"]["t"] and node["up"] > node["started"]
