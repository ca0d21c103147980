"""Offline checks of the Anyscale deployment files, cluster-configs/anyscale-*.yaml.

No Anyscale account, cloud or running Ray is needed:

1. Anyscale's own models. Each file is loaded the way the `anyscale` CLI
   loads it: `compute_config_type_from_yaml` (`anyscale compute-config create
   -f`), the CLI's job-schema check then `JobConfig.from_yaml` (`anyscale job
   submit -f`), `WorkspaceConfig.from_yaml` plus the name rule (`anyscale
   workspace_v2 create -f`), with warnings turned into errors. The models are
   frozen dataclasses built with `cls(**fields)` and one validator per field,
   so an unknown key at any level is a TypeError, and Anyscale's own TPU rules
   (tpu_hosts, the GKE TPU node selectors) run too.
2. What the models do not know: the TPU arithmetic against Ray's tables in
   `ray.util.tpu` (chips per host, hosts per slice, chips of the topology),
   the slice that examples/train_lm.py will reserve (ray_elastic's TpuSlice /
   GpuSlice, built from the job's own entrypoint) against the nodes the
   compute config gives, a head node that hosts no slice, retries on with
   checkpoints on gs://, the inline compute configs equal to the
   anyscale-compute-*.yaml files, one image with the KubeRay manifests, and
   EDIT comments on the fields a user changes.
3. Negative tests: mutated files are rejected, by Anyscale's models or by
   the checks above, so a green run means the checks ran.
"""

from __future__ import annotations

import argparse
import re
import shlex
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

# Not skipped when missing: `anyscale` is in the `test` extra, and these
# checks are only worth anything if they run.
from anyscale.compute_config.models import (
    ComputeConfig,
    WorkerNodeGroupConfig,
    compute_config_type_from_yaml,
)
from anyscale.job.models import JobConfig
from anyscale.workspace.models import WorkspaceConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster-configs"
TRAINER = "examples/train_lm.py"
DOC = ROOT / "docs" / "deploy-anyscale.md"

# GKE node label cloud.google.com/gke-tpu-accelerator -> Ray's TPU version.
GKE_TPU_ACCELERATORS = {
    "tpu-v4-podslice": "v4",
    "tpu-v5-lite-podslice": "v5litepod",
    "tpu-v5p-slice": "v5p",
    "tpu-v6e-slice": "v6e",
}
TPU_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
ACCELERATOR_LABEL = "ray.io/accelerator-type"

COMPUTES = sorted(CONFIGS.glob("anyscale-compute-*.yaml"))
JOBS = sorted(CONFIGS.glob("anyscale-job-*.yaml"))
WORKSPACES = sorted(CONFIGS.glob("anyscale-workspace-*.yaml"))
ALL = COMPUTES + JOBS + WORKSPACES


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _write(tmp_path: Path, data: dict, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _compute_file(suffix: str) -> Path:
    """The compute config of a suffix: "tpu-v6e" -> anyscale-compute-tpu-v6e.yaml."""
    return CONFIGS / f"anyscale-compute-{suffix}.yaml"


def _suffix(path: Path) -> str:
    """anyscale-job-tpu-v6e.yaml -> "tpu-v6e"."""
    return re.sub(r"^anyscale-(compute|job|workspace)-", "", path.stem)


def test_config_files_exist():
    names = {p.name for p in ALL}
    for suffix in ("tpu-v6e", "tpu-v5e", "gpu-l4"):
        for kind in ("compute", "job"):
            name = f"anyscale-{kind}-{suffix}.yaml"
            assert name in names, f"cluster-configs/{name} is missing"
    assert "anyscale-workspace-tpu-v6e.yaml" in names


# ---------------------------------------------------------------------------
# 1. Anyscale's models, as the CLI uses them
# ---------------------------------------------------------------------------


def load_compute(path: Path) -> ComputeConfig:
    """What `anyscale compute-config create -f PATH` builds before any API call."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = compute_config_type_from_yaml(str(path))
    assert isinstance(config, ComputeConfig), f"{path.name}: not a single-resource ComputeConfig"
    return config


def load_job(path: Path) -> JobConfig:
    """What `anyscale job submit -f PATH` builds before any API call."""
    from anyscale.commands.job_commands import _check_config_schema

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_config_schema(str(path), passed_with_config_flag=True)
        return JobConfig.from_yaml(str(path))


def load_workspace(path: Path) -> WorkspaceConfig:
    """What `anyscale workspace_v2 create -f PATH` builds before any API call."""
    from anyscale.utils.name_utils import validate_resource_name

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = WorkspaceConfig.from_yaml(str(path))
    validate_resource_name(config.name)
    return config


@pytest.mark.parametrize("path", COMPUTES, ids=_ids(COMPUTES))
def test_compute_config_loads_with_anyscale_model(path):
    config = load_compute(path)
    assert config.head_node is not None and config.worker_nodes, f"{path.name}: head and worker nodes must be explicit"


@pytest.mark.parametrize("path", JOBS, ids=_ids(JOBS))
def test_job_config_loads_with_anyscale_model(path):
    job = load_job(path)
    assert isinstance(job.compute_config, ComputeConfig), f"{path.name}: compute_config is not an inline ComputeConfig"


@pytest.mark.parametrize("path", WORKSPACES, ids=_ids(WORKSPACES))
def test_workspace_config_loads_with_anyscale_model(path):
    workspace = load_workspace(path)
    assert isinstance(workspace.compute_config, ComputeConfig)


# ---------------------------------------------------------------------------
# 2. ray_elastic's rules: TPU arithmetic, the trainer's slices, the head
# ---------------------------------------------------------------------------


def _selectors(group: WorkerNodeGroupConfig) -> dict:
    spec = (group.advanced_instance_config or {}).get("spec") or {}
    return spec.get("nodeSelector") or {}


def _tpu_groups(config: ComputeConfig) -> list[WorkerNodeGroupConfig]:
    return [g for g in config.worker_nodes or [] if g.required_resources and (g.required_resources.TPU or 0) > 0]


def _gpu_groups(config: ComputeConfig) -> list[WorkerNodeGroupConfig]:
    return [g for g in config.worker_nodes or [] if g.required_resources and (g.required_resources.GPU or 0) > 0]


def tpu_group_problems(group: WorkerNodeGroupConfig) -> list[str]:
    """One TPU worker group: its nodes (one per TPU host) must tile whole
    slices of the topology, as Ray's TPU tables see it."""
    from ray._private.accelerators import TPUAcceleratorManager
    from ray.util.tpu import get_chips_per_host, get_num_chips_from_topology

    name = group.name
    selector = _selectors(group)
    accelerator, topology = selector.get(TPU_SELECTOR), selector.get(TOPOLOGY_SELECTOR)
    if accelerator not in GKE_TPU_ACCELERATORS:
        return [f"{name}: nodeSelector {TPU_SELECTOR}={accelerator!r} is not one of {sorted(GKE_TPU_ACCELERATORS)}"]
    if not topology:
        return [f"{name}: nodeSelector {TOPOLOGY_SELECTOR} is missing"]
    version = GKE_TPU_ACCELERATORS[accelerator]
    if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
        tpu_accelerator_version=version, tpu_topology=topology
    ):
        return [f"{name}: topology {topology!r} does not exist for TPU {version}"]
    problems = []
    chips, hosts = group.required_resources.TPU, group.required_resources.tpu_hosts or 0
    per_host = get_chips_per_host(topology, version)
    if chips != per_host:
        problems.append(f"{name}: TPU {chips} per node, but a {version} {topology} host has {per_host} chips")
    total = get_num_chips_from_topology(topology)
    if chips * hosts != total:
        problems.append(
            f"{name}: {chips} chips x tpu_hosts {hosts} = {chips * hosts}, but topology {topology} has {total} chips"
        )
    if group.min_nodes != group.max_nodes:
        problems.append(
            f"{name}: min_nodes {group.min_nodes} != max_nodes {group.max_nodes} "
            "(fixed size: Anyscale replaces nodes, ray_elastic resizes)"
        )
    if hosts and group.min_nodes % hosts:
        problems.append(f"{name}: min_nodes {group.min_nodes} is not a whole number of slices of tpu_hosts {hosts}")
    return problems


def head_problems(config: ComputeConfig) -> list[str]:
    head = config.head_node
    problems = []
    resources = head.resources or {}
    if resources.get("CPU", None) != 0 or resources.get("GPU", 0) != 0:
        problems.append("head_node resources must be CPU 0 and GPU 0: the driver's node must not host slices")
    required = head.required_resources
    if required is not None and ((required.TPU or 0) or (required.GPU or 0)):
        problems.append("head_node asks for accelerators: it only runs the driver")
    return problems


def train_lm_args(entrypoint: str) -> tuple[argparse.Namespace, list[str]]:
    """Parse an entrypoint with examples/train_lm.py's own parser: its flags,
    defaults and types; flags it does not know are returned, not fatal."""
    argv = shlex.split(entrypoint)
    scripts = [i for i, a in enumerate(argv) if a == TRAINER or a.endswith("/" + TRAINER)]
    assert scripts, f"the entrypoint does not run {TRAINER}: {entrypoint!r}"
    assert Path(argv[0]).name.startswith("python"), f"the entrypoint does not start with python: {entrypoint!r}"
    from examples import train_lm

    unknown: list[str] = []

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        unknown.extend(rest)
        return ns

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        ns = train_lm.parse(argv[scripts[0] + 1 :])
    return ns, unknown


def checkpoint_args(entrypoint: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--checkpoint")
    parser.add_argument("--save-every", type=int)
    return parser.parse_known_args(shlex.split(entrypoint))[0]


def cluster_problems(config: ComputeConfig, entrypoint: str) -> list[str]:
    """Does the cluster give the slices the trainer's entrypoint reserves?"""
    from examples import train_lm
    from ray.util.tpu import get_tpu_version_from_type

    from ray_elastic.config import TpuSlice

    args, _ = train_lm_args(entrypoint)
    problems = head_problems(config)
    tpu, gpu = _tpu_groups(config), _gpu_groups(config)
    if len(tpu) + len(gpu) != 1:
        return problems + [f"expected one TPU or GPU worker group, found {len(tpu)} TPU and {len(gpu)} GPU"]
    try:
        spec = train_lm.slice_spec(args)
    except Exception as exc:  # ray_elastic's ConfigError: a bad flag
        return problems + [f"the entrypoint's slice is invalid: {exc}"]
    bundles = spec.bundles()
    if tpu:
        (group,) = tpu
        problems += tpu_group_problems(group)
        if not isinstance(spec, TpuSlice):
            return problems + ["a TPU cluster, but the entrypoint has no --tpu-topology / --tpu-version"]
        selector = _selectors(group)
        topology, accelerator = selector.get(TOPOLOGY_SELECTOR), selector.get(TPU_SELECTOR)
        required = group.required_resources
        if args.tpu_topology != topology:
            problems.append(f"--tpu-topology {args.tpu_topology!r} != nodeSelector topology {topology!r}")
        if get_tpu_version_from_type(args.tpu_version or "") != GKE_TPU_ACCELERATORS.get(accelerator):
            problems.append(f"--tpu-version {args.tpu_version!r} does not match nodeSelector {accelerator!r}")
        if spec.hosts != required.tpu_hosts:
            problems.append(
                f"{group.name}: tpu_hosts {required.tpu_hosts}, but ray_elastic's TpuSlice reserves {spec.hosts} hosts"
            )
        if bundles[0].get("TPU") != required.TPU:
            problems.append(
                f"{group.name}: TpuSlice wants {bundles[0].get('TPU')} TPU per host, a node has {required.TPU}"
            )
    else:
        (group,) = gpu
        required = group.required_resources
        if bundles[0].get("GPU") != required.GPU:
            problems.append(f"--gpus-per-host {args.gpus_per_host:g} != GPU {required.GPU} per node")
        label = (group.required_labels or {}).get(ACCELERATOR_LABEL)
        if required.accelerator and label and label != required.accelerator:
            problems.append(f"{group.name}: {ACCELERATOR_LABEL} {label!r} != accelerator {required.accelerator!r}")
        if group.min_nodes != group.max_nodes:
            problems.append(f"{group.name}: min_nodes {group.min_nodes} != max_nodes {group.max_nodes}")
    if bundles[0].get("CPU", 0) > (group.required_resources.CPU or 0):
        problems.append(
            f"{group.name}: the slice wants {bundles[0]['CPU']} CPU per host, a node has {group.required_resources.CPU}"
        )
    if args.slices * len(bundles) != group.min_nodes:
        problems.append(f"--slices {args.slices} x {len(bundles)} hosts per slice != min_nodes {group.min_nodes}")
    return problems


def job_problems(job: JobConfig) -> list[str]:
    """The job's own settings: retries, durable checkpoints, working_dir, the
    inline compute config equal to its file, one image with KubeRay."""
    problems = []
    checkpoint = checkpoint_args(job.entrypoint)
    if not (job.max_retries or 0) >= 1:
        problems.append(
            f"max_retries {job.max_retries}: retries must be on, so a lost driver resumes from the checkpoint"
        )
    if not (checkpoint.checkpoint or "").startswith("gs://"):
        problems.append(f"--checkpoint {checkpoint.checkpoint!r}: a retry resumes only from durable storage (gs://)")
    if checkpoint.save_every is not None and checkpoint.save_every < 1:
        problems.append(f"--save-every {checkpoint.save_every} must be positive")
    if job.working_dir != ".":
        problems.append(f"working_dir {job.working_dir!r}: submit the checkout ('.') from the repository root")
    if ".git" not in (job.excludes or []):
        problems.append("excludes does not leave out .git")
    return problems


def _raw_compute(path: Path) -> dict:
    return _load_yaml(_compute_file(_suffix(path)))


@pytest.mark.parametrize("path", COMPUTES, ids=_ids(COMPUTES))
def test_compute_tpu_arithmetic_and_head(path):
    config = load_compute(path)
    problems = head_problems(config)
    for group in _tpu_groups(config):
        problems += tpu_group_problems(group)
    assert problems == []


@pytest.mark.parametrize("path", JOBS, ids=_ids(JOBS))
def test_job_cluster_fits_its_entrypoint(path):
    job = load_job(path)
    assert cluster_problems(job.compute_config, job.entrypoint) == []


@pytest.mark.parametrize("path", JOBS, ids=_ids(JOBS))
def test_job_retries_and_durable_checkpoints(path):
    assert job_problems(load_job(path)) == []


@pytest.mark.parametrize("path", JOBS + WORKSPACES, ids=_ids(JOBS + WORKSPACES))
def test_inline_compute_config_equals_its_file(path):
    raw = _load_yaml(path)
    compute = _compute_file(_suffix(path))
    assert compute.is_file(), f"{path.name} has no {compute.name}"
    assert raw["compute_config"] == _load_yaml(compute), f"{path.name}: compute_config differs from {compute.name}"
    assert raw["cloud"] == raw["compute_config"]["cloud"], f"{path.name}: cloud differs from compute_config.cloud"


@pytest.mark.parametrize("path", JOBS + WORKSPACES, ids=_ids(JOBS + WORKSPACES))
def test_one_image_with_the_kuberay_manifests(path):
    """The image is the one cluster-configs/Dockerfile builds (its Ray version
    is checked against pyproject.toml by tests/test_cluster_configs.py)."""
    image = _load_yaml(path)["image_uri"]
    rayjob = CONFIGS / f"rayjob-{_suffix(path)}.yaml"
    assert rayjob.is_file(), f"{path.name}: no KubeRay manifest {rayjob.name} to share the image with"
    head = _load_yaml(rayjob)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert image == head["image"], f"{path.name}: image_uri {image!r} != {rayjob.name}'s {head['image']!r}"


def test_workspace_runs_the_tpu_job_cluster():
    workspace = _load_yaml(CONFIGS / "anyscale-workspace-tpu-v6e.yaml")
    job = _load_yaml(CONFIGS / "anyscale-job-tpu-v6e.yaml")
    assert workspace["compute_config"] == job["compute_config"]
    assert workspace["image_uri"] == job["image_uri"]


# The fields a user edits, and a pattern for the YAML lines that set them.
EDITED = {
    "cloud": r"^\s*cloud:",
    "project": r"^project:",
    "image": r"^image_uri:",
    "topology": r"gke-tpu-topology:",
    "hosts per slice": r"tpu_hosts:",
    "nodes (slices)": r"^\s*(min|max)_nodes:",
    "GPUs per node": r"^\s*GPU: [1-9]",
}


def edit_comment_problems(name: str, text: str) -> list[str]:
    problems = []
    lines = text.splitlines()
    for what, pattern in EDITED.items():
        for line in (x for x in lines if re.search(pattern, x)):
            if "# EDIT" not in line:
                problems.append(f"{name}: the {what} line has no '# EDIT' comment: {line.strip()!r}")
    entrypoints = [i for i, x in enumerate(lines) if x.startswith("entrypoint:")]
    for at in entrypoints:
        above = "\n".join(lines[max(0, at - 6) : at])
        for flag in ("--slices", "--checkpoint"):
            if "EDIT" not in above or flag not in above:
                problems.append(f"{name}: the comment above entrypoint does not say to edit {flag}")
        if "gs://MY_BUCKET/" not in lines[at]:
            problems.append(f"{name}: the checkpoint bucket is not the MY_BUCKET placeholder")
    return problems


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_comments_mark_the_fields_to_edit(path):
    assert edit_comment_problems(path.name, path.read_text()) == []
    if path in JOBS:
        assert any(x.startswith("entrypoint:") for x in path.read_text().splitlines())


@pytest.mark.parametrize("path", JOBS, ids=_ids(JOBS))
def test_entrypoint_needs_only_the_checkpoint_flags_beyond_train_lm(path):
    """Everything but --checkpoint / --save-every already parses with
    train_lm.py's own parser (values and types included)."""
    _, unknown = train_lm_args(load_job(path).entrypoint)
    assert unknown == [], unknown


@pytest.mark.parametrize("path", JOBS, ids=_ids(JOBS))
def test_entrypoint_parses_with_train_lm(path):
    _, unknown = train_lm_args(load_job(path).entrypoint)
    assert unknown == [], f"{path.name}: examples/train_lm.py rejects {unknown}"


# ---------------------------------------------------------------------------
# Docs
# ---------------------------------------------------------------------------


def test_readme_lists_the_anyscale_files():
    readme = (CONFIGS / "README.md").read_text()
    for path in ALL:
        assert f"`{path.name}`" in readme, f"cluster-configs/README.md does not list {path.name}"


def test_deploy_doc_covers_the_files_and_the_ways_to_run():
    doc = DOC.read_text()
    assert TRAINER in doc
    for path in ALL:
        assert path.name in doc, f"docs/deploy-anyscale.md does not mention {path.name}"
    for what in ("anyscale job submit -f", "anyscale workspace_v2", "notebook", "Metrics", "max_retries"):
        assert what in doc, f"docs/deploy-anyscale.md does not cover {what!r}"
    assert "docs/deploy-anyscale.md" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------
# 3. Negative tests: the checks do reject bad files
# ---------------------------------------------------------------------------


def _v6e_job() -> dict:
    return _load_yaml(CONFIGS / "anyscale-job-tpu-v6e.yaml")


def _tpu_group(data: dict) -> dict:
    return data["compute_config"]["worker_nodes"][0]


def _problems(tmp_path: Path, data: dict) -> list[str]:
    """Load with Anyscale's model (which must accept it), then ray_elastic's checks."""
    job = load_job(_write(tmp_path, data))
    return cluster_problems(job.compute_config, job.entrypoint) + job_problems(job)


def test_anyscale_rejects_an_unknown_field(tmp_path):
    data = _v6e_job()
    data["max_retry"] = 3  # typo of max_retries
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_retry'"):
        load_job(_write(tmp_path, data))
    data = _v6e_job()
    _tpu_group(data)["min_node"] = 8  # typo of min_nodes, inside the inline compute config
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_node'"):
        load_job(_write(tmp_path, data))
    compute = _load_yaml(CONFIGS / "anyscale-compute-tpu-v6e.yaml")
    compute["head_node"]["num_cpus"] = 0  # a Ray option, not an Anyscale field
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_cpus'"):
        load_compute(_write(tmp_path, compute))
    workspace = _load_yaml(CONFIGS / "anyscale-workspace-tpu-v6e.yaml")
    workspace["entrypoint"] = "python examples/train_lm.py"  # a job field on a workspace
    with pytest.raises(TypeError, match="unexpected keyword argument 'entrypoint'"):
        load_workspace(_write(tmp_path, workspace))


def test_anyscale_rejects_legacy_fields_and_wrong_types(tmp_path):
    import click

    data = _v6e_job()
    data["runtime_env"] = {"working_dir": "."}  # the legacy job schema's field
    with pytest.raises(click.ClickException, match="mixes fields from two incompatible job config schemas"):
        load_job(_write(tmp_path, data))
    data = _v6e_job()
    data["max_retries"] = "3"
    with pytest.raises(TypeError, match="'max_retries' must be an int"):
        load_job(_write(tmp_path, data))
    data = _v6e_job()
    _tpu_group(data)["required_resources"]["memory"] = "lots"
    with pytest.raises(TypeError, match="Invalid memory"):
        load_job(_write(tmp_path, data))
    data = _v6e_job()
    _tpu_group(data)["max_nodes"] = 4  # below min_nodes 8
    with pytest.raises(TypeError, match="'max_nodes' must be >= 'min_nodes'"):
        load_job(_write(tmp_path, data))


def test_anyscale_own_tpu_rules(tmp_path):
    data = _v6e_job()
    del _tpu_group(data)["required_resources"]["tpu_hosts"]
    with pytest.raises(TypeError, match="requires 'tpu_hosts'"):
        load_job(_write(tmp_path, data))
    data = _v6e_job()
    del _tpu_group(data)["advanced_instance_config"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR]
    with pytest.raises(TypeError, match="TPU configuration requires either"):
        load_job(_write(tmp_path, data))


def test_wrong_topology_is_caught_against_ray_tpu_tables(tmp_path):
    # 4x8 is a real v6e topology (32 chips = 8 hosts), so Anyscale's model
    # accepts it; 4 chips x tpu_hosts 4 no longer tile it.
    data = _v6e_job()
    _tpu_group(data)["advanced_instance_config"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR] = "4x8"
    problems = _problems(tmp_path, data)
    assert any("4 chips x tpu_hosts 4 = 16, but topology 4x8 has 32 chips" in p for p in problems), problems
    assert any("--tpu-topology '4x4' != nodeSelector topology '4x8'" in p for p in problems), problems
    # ... and with the flag following it, TpuSlice reserves 8 hosts, not 4.
    data["entrypoint"] = data["entrypoint"].replace("--tpu-topology 4x4", "--tpu-topology 4x8")
    problems = _problems(tmp_path, data)
    assert any("TpuSlice reserves 8 hosts" in p for p in problems), problems
    # No such v6e topology at all.
    _tpu_group(data)["advanced_instance_config"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR] = "3x3"
    assert any("does not exist for TPU v6e" in p for p in _problems(tmp_path, data))
    # Chips per host that a 4x4 host does not have.
    data = _v6e_job()
    _tpu_group(data)["required_resources"]["TPU"] = 8
    problems = _problems(tmp_path, data)
    assert any("TPU 8 per node, but a v6e 4x4 host has 4 chips" in p for p in problems), problems
    # The wrong TPU generation for the node pool.
    data = _v6e_job()
    data["entrypoint"] = data["entrypoint"].replace("--tpu-version v6e", "--tpu-version v5litepod")
    assert any("does not match nodeSelector 'tpu-v6e-slice'" in p for p in _problems(tmp_path, data))


def test_slice_count_head_retries_and_checkpoint_are_checked(tmp_path):
    data = _v6e_job()
    data["entrypoint"] = data["entrypoint"].replace("--slices 2", "--slices 3")
    assert any("--slices 3 x 4 hosts per slice != min_nodes 8" in p for p in _problems(tmp_path, data))
    data = _v6e_job()
    _tpu_group(data)["min_nodes"] = _tpu_group(data)["max_nodes"] = 6
    problems = _problems(tmp_path, data)
    assert any("not a whole number of slices" in p for p in problems), problems
    data = _v6e_job()
    del data["compute_config"]["head_node"]["resources"]
    assert any("driver's node must not host slices" in p for p in _problems(tmp_path, data))
    data = _v6e_job()
    data["max_retries"] = 0
    assert any("retries must be on" in p for p in _problems(tmp_path, data))
    data = _v6e_job()
    data["entrypoint"] = re.sub(r"--checkpoint \S+", "--checkpoint /tmp/ckpt", data["entrypoint"])
    assert any("durable storage (gs://)" in p for p in _problems(tmp_path, data))
    data = _v6e_job()
    data["entrypoint"] = "python -m ray_elastic.cli demo --slices 2"
    with pytest.raises(AssertionError, match="does not run examples/train_lm.py"):
        _problems(tmp_path, data)


def test_gpu_checks_catch_a_wrong_gpu_count(tmp_path):
    data = _load_yaml(CONFIGS / "anyscale-job-gpu-l4.yaml")
    data["entrypoint"] = data["entrypoint"].replace("--gpus-per-host 1", "--gpus-per-host 2")
    assert any("--gpus-per-host 2 != GPU 1 per node" in p for p in _problems(tmp_path, data))
    data = _load_yaml(CONFIGS / "anyscale-job-gpu-l4.yaml")
    data["compute_config"]["worker_nodes"][0]["required_labels"][ACCELERATOR_LABEL] = "A100"
    assert any("!= accelerator 'L4'" in p for p in _problems(tmp_path, data))


def test_inline_compute_config_drift_is_caught():
    data = _v6e_job()
    _tpu_group(data)["required_resources"]["CPU"] = 47
    assert data["compute_config"] != _load_yaml(CONFIGS / "anyscale-compute-tpu-v6e.yaml")


def test_edit_comment_check_catches_a_missing_comment():
    text = (CONFIGS / "anyscale-job-tpu-v6e.yaml").read_text()
    bad = re.sub(r"(gke-tpu-topology: 4x4)\s+#.*", r"\1", text)
    assert any("the topology line has no '# EDIT' comment" in p for p in edit_comment_problems("job", bad))
    bad = text.replace("#       --checkpoint = your bucket", "#       the bucket")
    assert any("does not say to edit --checkpoint" in p for p in edit_comment_problems("job", bad))
