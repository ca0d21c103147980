"""Offline checks of the deployment files in cluster-configs/.

Three layers, none of which needs a Kubernetes cluster, a cloud account or a
running Ray:

1. Schema. Every KubeRay manifest is validated, as a whole object, against
   the OpenAPI v3 schema of its CustomResourceDefinition (RayCluster, RayJob;
   kept in ../shared/kuberay-crds). The schema is first turned into what the
   API server enforces and plain JSON Schema does not: unknown fields are
   rejected (kubectl's default strict field validation), int-or-string,
   nullable, int32/int64 ranges, `x-kubernetes-list-type` uniqueness and the
   CRDs' CEL rules (`x-kubernetes-validations`). The GCP cluster-launcher
   YAMLs are validated against the `ray-schema.json` shipped in the ray
   package, and through `prepare_config` + `validate_config` as `ray up` does.
2. What users get wrong and no schema sees: TPU chips per host times
   `numOfHosts` equals the chips of the topology (Ray's own TPU tables), the
   GKE node selectors are present and agree with the trainer's flags, slices
   = replicas, the entrypoint runs examples/train_lm.py, the RayJob's cluster
   equals the RayCluster of the same name, one image and one Ray version
   everywhere (= the pin in pyproject.toml), the head hosts no workers;
   production settings: token authentication on for every node (KubeRay
   `authOptions.mode: token`; the launchers' RAY_AUTH_MODE=token and token
   file), the head's node health checks tuned for training, GCS fault
   tolerance (`gcsFaultToleranceOptions`: an external Redis, its password
   from a Secret), and RayJob retries (`backoffLimit` >= 1) that resume from
   a `gs://` checkpoint.
3. Negative tests: mutated manifests are rejected, so a green run means the
   validators ran, not that they accept anything.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster-configs"
# In CI the CRDs sit next to the repository: <parent>/shared/kuberay-crds.
CRD_DIR = Path(
    os.environ.get("KUBERAY_CRDS_DIR", Path(__file__).resolve().parents[2] / "shared" / "kuberay-crds")
)
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}

TRAINER = "examples/train_lm.py"
# GKE node label cloud.google.com/gke-tpu-accelerator -> Ray's TPU version.
GKE_TPU_ACCELERATORS = {
    "tpu-v4-podslice": "v4",
    "tpu-v5-lite-podslice": "v5litepod",
    "tpu-v5p-slice": "v5p",
    "tpu-v6e-slice": "v6e",
}
TPU_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
GPU_SELECTOR = "cloud.google.com/gke-accelerator"


def _load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


def _files(pattern: str) -> list[Path]:
    return sorted(CONFIGS.glob(pattern))


MANIFESTS = _files("raycluster-*.yaml") + _files("rayjob-*.yaml")
LAUNCHERS = _files("gcp-launcher-*.yaml")


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_config_files_exist():
    names = {p.name for p in MANIFESTS + LAUNCHERS}
    for want in (
        "raycluster-tpu-v5e.yaml",
        "rayjob-tpu-v5e.yaml",
        "raycluster-tpu-v6e.yaml",
        "rayjob-tpu-v6e.yaml",
        "raycluster-gpu-l4.yaml",
        "rayjob-gpu-l4.yaml",
        "gcp-launcher-gpu-l4.yaml",
        "gcp-launcher-tpu-v6e.yaml",
    ):
        assert want in names, f"cluster-configs/{want} is missing"


# ---------------------------------------------------------------------------
# 1. CRD schema -> JSON Schema with the API server's extra rules
# ---------------------------------------------------------------------------


def openapi_to_jsonschema(node: Any) -> Any:
    """A copy of a CRD's structural OpenAPI v3 schema that jsonschema enforces
    the way the Kubernetes API server does.

    - an object with `properties` and neither `additionalProperties` nor
      `x-kubernetes-preserve-unknown-fields` rejects unknown fields (kubectl
      apply defaults to --validate=strict, which turns the server's pruning of
      unknown fields into an error);
    - `x-kubernetes-int-or-string: true` means integer or string;
    - `nullable: true` admits null.
    Other `x-kubernetes-*` keys are kept for the validator's own keywords.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {k: openapi_to_jsonschema(v) for k, v in value.items()}
        elif key == "default":
            out[key] = value  # data, not a schema
        else:
            out[key] = openapi_to_jsonschema(value)
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        branches = out.get("anyOf") or []
        types = {b.get("type") for b in branches if isinstance(b, dict)}
        if not {"integer", "string"} <= types:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


_CEL_TOKEN = re.compile(r"\s*(has\(self\.[A-Za-z_]\w*\)|'[^']*'|&&|\|\||!|\(|\)|\[|\]|,|\bself\b|\bin\b)")
_CEL_TO_PYTHON = {"&&": "and", "||": "or", "!": "not"}


def cel_rule_holds(rule: str, instance: Any) -> bool | None:
    """Evaluates the small CEL subset the KubeRay CRDs use (has(), !, &&, ||,
    `self in ['...']`) for a create. Transition rules (oldSelf) do not apply
    to a create and hold. Returns None for a rule outside that subset."""
    if re.fullmatch(r"\s*self\s*==\s*oldSelf\s*", rule):
        return True
    python, pos = [], 0
    while pos < len(rule.rstrip()):
        m = _CEL_TOKEN.match(rule, pos)
        if not m:
            return None
        token, pos = m.group(1), m.end()
        if token.startswith("has("):
            python.append(repr(isinstance(instance, dict) and token[len("has(self.") : -1] in instance))
        else:
            python.append(_CEL_TO_PYTHON.get(token, token))
    try:  # only the tokens above reach eval: booleans, string literals, self, in, and/or/not, brackets
        return bool(eval(" ".join(python), {"__builtins__": {}}, {"self": instance}))  # noqa: S307
    except Exception:
        return None


def _list_type(validator, list_type, instance, schema) -> Iterator[Any]:
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate entry {item!r} in a list-type=set list")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        item_props = schema.get("items", {}).get("properties", {})
        seen = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(
                    f"duplicate entry with {dict(zip(keys, key))} in a list keyed by {keys}"
                )
            seen.add(key)


def _cel_validations(validator, rules, instance, schema) -> Iterator[Any]:
    for rule in rules:
        holds = cel_rule_holds(rule["rule"], instance)
        if holds is None:
            yield jsonschema.ValidationError(
                f"CEL rule {rule['rule']!r} cannot be evaluated offline; extend cel_rule_holds"
            )
        elif not holds:
            yield jsonschema.ValidationError(rule.get("message") or f"CEL rule {rule['rule']!r} failed")


def _format_checker():
    checker = jsonschema.FormatChecker(formats=())

    def int_range(bits: int):
        def check(value: Any) -> bool:
            if isinstance(value, bool) or not isinstance(value, int):
                return True
            return -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)

        return check

    checker.checks("int32")(int_range(32))
    checker.checks("int64")(int_range(64))
    return checker


KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel_validations},
)


def _crds_or_skip() -> Path:
    if not all((CRD_DIR / f).is_file() for f in CRD_FILES.values()):
        pytest.skip(
            f"KubeRay CRDs not found in {CRD_DIR} (expected {', '.join(CRD_FILES.values())}; "
            "in CI they are at ../shared/kuberay-crds next to the repository, "
            "or set KUBERAY_CRDS_DIR)"
        )
    return CRD_DIR


@functools.lru_cache(maxsize=None)
def _validator(kind: str):
    crd = _load_yaml(_crds_or_skip() / CRD_FILES[kind])
    assert crd["spec"]["names"]["kind"] == kind
    versions = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert versions, f"{CRD_FILES[kind]} has no v1 version"
    schema = openapi_to_jsonschema(versions[0]["schema"]["openAPIV3Schema"])
    KubeValidator.check_schema(schema)
    return KubeValidator(schema, format_checker=_format_checker())


def schema_errors(manifest: dict) -> list[str]:
    """Every way `manifest` breaks its CRD schema, as 'path: message'."""
    kind = manifest.get("kind")
    if kind not in CRD_FILES:
        return [f"kind: {kind!r} is not one of {sorted(CRD_FILES)}"]
    errors = [
        "/".join(str(p) for p in e.absolute_path) + ": " + e.message
        for e in _validator(kind).iter_errors(manifest)
    ]
    if manifest.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion: {manifest.get('apiVersion')!r} is not ray.io/v1")
    errors += _metadata_errors(manifest)
    return errors


def _metadata_errors(manifest: dict) -> list[str]:
    # What KubeRay's webhook/controller checks on names: a DNS-1035 label,
    # at most 53 characters for a RayCluster and 47 for a RayJob (whose
    # cluster name gets a 6-character suffix).
    name = (manifest.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        return [f"metadata.name: {name!r} is not a DNS-1035 label"]
    limit = {"RayCluster": 53, "RayJob": 47}[manifest["kind"]]
    if len(name) > limit:
        return [f"metadata.name: {name!r} is longer than {limit} characters"]
    return []


def test_every_cel_rule_of_the_crds_is_understood():
    # If a new CRD brings a rule outside cel_rule_holds' subset, say so now
    # rather than when a manifest first sets that field.
    def rules(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                yield rule["rule"]
            for value in node.values():
                yield from rules(value)
        elif isinstance(node, list):
            for value in node:
                yield from rules(value)

    found = [r for kind in CRD_FILES for r in rules(_validator(kind).schema)]
    assert found, "no CEL rules found: has the CRD layout changed?"
    for rule in found:
        assert cel_rule_holds(rule, {}) is not None, f"CEL rule outside the evaluated subset: {rule}"


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_manifest_matches_crd_schema(path):
    manifest = _load_yaml(path)
    assert schema_errors(manifest) == []


# ---------------------------------------------------------------------------
# 2. What matters to users beyond the schema
# ---------------------------------------------------------------------------


def _cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec["rayClusterSpec"] if manifest["kind"] == "RayJob" else spec


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _quantity(resources: dict, which: str, name: str) -> int | None:
    value = (resources.get(which) or {}).get(name)
    return None if value is None else int(value)


def _cpu(value: Any) -> float:
    value = str(value)
    return int(value[:-1]) / 1000 if value.endswith("m") else float(value)


def trainer_args(entrypoint: str) -> argparse.Namespace:
    """The flags given to examples/train_lm.py in an entrypoint."""
    argv = shlex.split(entrypoint)
    scripts = [i for i, a in enumerate(argv) if a == TRAINER or a.endswith("/" + TRAINER)]
    assert scripts, f"entrypoint {entrypoint!r} does not run {TRAINER}"
    assert scripts[0] > 0 and argv[scripts[0] - 1].startswith("python"), (
        f"entrypoint {entrypoint!r}: run {TRAINER} with python"
    )

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # an assertion, not a SystemExit
            raise AssertionError(f"entrypoint {entrypoint!r}: {message}")

    parser = Parser(add_help=False)
    parser.add_argument("--slices", type=int, required=True)
    parser.add_argument("--policy", choices=("resize", "pause"), default="pause")
    parser.add_argument("--tpu-topology")
    parser.add_argument("--tpu-version")
    parser.add_argument("--gpus-per-host", type=int, default=1)
    parser.add_argument("--hosts-per-slice", type=int, default=1)
    parser.add_argument("--checkpoint")
    parser.add_argument("--save-every", type=int)
    args, _ = parser.parse_known_args(argv[scripts[0] + 1 :])
    return args


def tpu_group_problems(group: dict) -> list[str]:
    """A TPU worker group is one ray_elastic slice per replica: its pods must
    tile the topology exactly, as Ray's TPU tables and TpuSlice see it."""
    from ray._private.accelerators import TPUAcceleratorManager
    from ray.util.tpu import get_chips_per_host, get_num_chips_from_topology

    from ray_elastic.config import TpuSlice

    name = group.get("groupName")
    pod = group["template"]
    selector = pod["spec"].get("nodeSelector") or {}
    problems = []
    accelerator, topology = selector.get(TPU_SELECTOR), selector.get(TOPOLOGY_SELECTOR)
    if accelerator not in GKE_TPU_ACCELERATORS:
        problems.append(
            f"{name}: nodeSelector {TPU_SELECTOR}={accelerator!r} is not one of {sorted(GKE_TPU_ACCELERATORS)}"
        )
    if not topology:
        problems.append(f"{name}: nodeSelector {TOPOLOGY_SELECTOR} is missing")
    if problems:
        return problems
    version = GKE_TPU_ACCELERATORS[accelerator]
    if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
        tpu_accelerator_version=version, tpu_topology=topology
    ):
        return [f"{name}: topology {topology!r} does not exist for TPU {version}"]
    hosts = group.get("numOfHosts", 1)
    tpu_containers = [c for c in _containers(pod) if "google.com/tpu" in (c.get("resources", {}).get("limits") or {})]
    if len(tpu_containers) != 1:
        return [f"{name}: expected one container with a google.com/tpu limit, found {len(tpu_containers)}"]
    resources = tpu_containers[0]["resources"]
    chips = _quantity(resources, "limits", "google.com/tpu")
    requested = _quantity(resources, "requests", "google.com/tpu")
    if requested not in (None, chips):
        problems.append(f"{name}: google.com/tpu request {requested} != limit {chips} (GKE requires them equal)")
    if chips != get_chips_per_host(topology, version):
        problems.append(
            f"{name}: google.com/tpu {chips} per pod, but a {version} {topology} host has "
            f"{get_chips_per_host(topology, version)} chips"
        )
    if chips * hosts != get_num_chips_from_topology(topology):
        problems.append(
            f"{name}: {chips} chips x numOfHosts {hosts} = {chips * hosts}, but topology {topology} "
            f"has {get_num_chips_from_topology(topology)} chips"
        )
    slice_spec = TpuSlice(topology=topology, accelerator_version=version)
    bundles = slice_spec.bundles()
    if len(bundles) != hosts:
        problems.append(f"{name}: numOfHosts {hosts}, but ray_elastic's TpuSlice reserves {len(bundles)} hosts")
    cpus = _cpu((resources.get("limits") or {}).get("cpu", 0))
    for bundle in bundles[:1]:
        if bundle.get("TPU") != chips:
            problems.append(f"{name}: TpuSlice wants {bundle.get('TPU')} TPU per host, the pod has {chips}")
        if bundle.get("CPU", 0) > cpus:
            problems.append(f"{name}: TpuSlice wants {bundle['CPU']} CPU per host, the pod has {cpus}")
    tolerations = pod["spec"].get("tolerations") or []
    if not any(t.get("key") == "google.com/tpu" for t in tolerations):
        problems.append(f"{name}: no toleration for the google.com/tpu taint of TPU nodes")
    return problems


def gpu_group_problems(group: dict) -> list[str]:
    name = group.get("groupName")
    pod = group["template"]
    problems = []
    if not (pod["spec"].get("nodeSelector") or {}).get(GPU_SELECTOR):
        problems.append(f"{name}: nodeSelector {GPU_SELECTOR} is missing")
    gpu_containers = [c for c in _containers(pod) if "nvidia.com/gpu" in (c.get("resources", {}).get("limits") or {})]
    if len(gpu_containers) != 1:
        return problems + [f"{name}: expected one container with an nvidia.com/gpu limit"]
    resources = gpu_containers[0]["resources"]
    gpus = _quantity(resources, "limits", "nvidia.com/gpu")
    if _quantity(resources, "requests", "nvidia.com/gpu") not in (None, gpus) or gpus < 1:
        problems.append(f"{name}: nvidia.com/gpu request must equal the limit (>= 1)")
    return problems


def _accelerator_groups(cluster_spec: dict, resource: str) -> list[dict]:
    return [
        g
        for g in cluster_spec.get("workerGroupSpecs") or []
        if any(resource in (c.get("resources", {}).get("limits") or {}) for c in _containers(g["template"]))
    ]


def cluster_problems(manifest: dict) -> list[str]:
    """Beyond-schema problems of a RayCluster or RayJob manifest."""
    spec = _cluster_spec(manifest)
    problems = []
    if spec.get("rayVersion") != _ray_pin():
        problems.append(f"rayVersion {spec.get('rayVersion')!r} != the ray pin {_ray_pin()} in pyproject.toml")
    head = spec["headGroupSpec"]
    if str((head.get("rayStartParams") or {}).get("num-cpus")) != "0":
        problems.append("head rayStartParams num-cpus must be \"0\": the driver's node must not host slices")
    groups = spec.get("workerGroupSpecs") or []
    pods = [head["template"]] + [g["template"] for g in groups]
    images = {c.get("image") for p in pods for c in _containers(p)}
    if len(images) != 1:
        problems.append(f"head and workers run different images: {sorted(map(str, images))}")
    for g in groups:
        if not g.get("minReplicas", 0) <= g.get("replicas", 0) <= g.get("maxReplicas", 2**31 - 1):
            problems.append(f"{g['groupName']}: replicas outside [minReplicas, maxReplicas]")
    tpu, gpu = _accelerator_groups(spec, "google.com/tpu"), _accelerator_groups(spec, "nvidia.com/gpu")
    if not (tpu or gpu):
        problems.append("no worker group requests google.com/tpu or nvidia.com/gpu")
    for g in tpu:
        problems += tpu_group_problems(g)
    for g in gpu:
        problems += gpu_group_problems(g)
    if manifest["kind"] == "RayJob":
        problems += _entrypoint_problems(manifest, tpu, gpu)
    return problems


def _entrypoint_problems(job: dict, tpu: list[dict], gpu: list[dict]) -> list[str]:
    from ray.util.tpu import get_tpu_version_from_type

    spec = job["spec"]
    args = trainer_args(spec.get("entrypoint", ""))
    problems = []
    hosts = sum(g.get("replicas", 0) * g.get("numOfHosts", 1) for g in tpu + gpu)
    if tpu:
        slices = sum(g.get("replicas", 0) for g in tpu)
        if args.slices != slices:
            problems.append(f"--slices {args.slices} != {slices} TPU slices (replicas)")
        node_selectors = [g["template"]["spec"]["nodeSelector"] for g in tpu]
        selectors = {(n.get(TPU_SELECTOR), n.get(TOPOLOGY_SELECTOR)) for n in node_selectors}
        if len(selectors) != 1:
            problems.append(f"TPU groups of different kinds: {sorted(selectors)}")
        accelerator, topology = next(iter(selectors))
        if args.tpu_topology != topology:
            problems.append(f"--tpu-topology {args.tpu_topology!r} != nodeSelector topology {topology!r}")
        try:
            version = get_tpu_version_from_type(args.tpu_version or "")
        except ValueError as exc:
            problems.append(f"--tpu-version: {exc}")
        else:
            if GKE_TPU_ACCELERATORS.get(accelerator) != version:
                problems.append(f"--tpu-version {args.tpu_version!r} does not match nodeSelector {accelerator!r}")
    else:
        if args.slices * args.hosts_per_slice != hosts:
            problems.append(f"--slices {args.slices} x --hosts-per-slice {args.hosts_per_slice} != {hosts} GPU pods")
        for g in gpu:
            for c in _containers(g["template"]):
                gpus = _quantity(c.get("resources", {}), "limits", "nvidia.com/gpu")
                if gpus is not None and gpus != args.gpus_per_host:
                    problems.append(f"--gpus-per-host {args.gpus_per_host} != nvidia.com/gpu {gpus} per pod")
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    if not isinstance(runtime_env, dict):
        problems.append("runtimeEnvYAML is not a mapping")
    elif (
        str(runtime_env.get("working_dir", "")).startswith("/")
        and spec.get("submissionMode", "K8sJobMode") != "K8sJobMode"
    ):
        problems.append("a local working_dir needs submissionMode K8sJobMode (the submitter pod uploads it)")
    return problems


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_manifest_fits_the_trainer(path):
    assert cluster_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", _files("rayjob-*.yaml"), ids=_ids(_files("rayjob-*.yaml")))
def test_rayjob_matches_its_raycluster(path):
    job = _load_yaml(path)
    assert job["kind"] == "RayJob"
    assert TRAINER in job["spec"]["entrypoint"]
    pair = path.with_name(path.name.replace("rayjob-", "raycluster-", 1))
    assert pair.is_file(), f"{path.name} has no {pair.name}"
    cluster = _load_yaml(pair)
    assert cluster["kind"] == "RayCluster"
    assert job["spec"]["rayClusterSpec"] == cluster["spec"], f"{path.name}: rayClusterSpec differs from {pair.name}"


@functools.lru_cache(maxsize=None)
def _ray_pin() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"ray(?:\[[^\]]*\])?==([0-9][^"]*)"', text)
    assert match, "pyproject.toml does not pin ray"
    return match.group(1)


def test_one_ray_version_everywhere():
    import ray

    pin = _ray_pin()
    assert ray.__version__ == pin, "the installed ray differs from pyproject's pin"
    for path in MANIFESTS:
        assert _cluster_spec(_load_yaml(path))["rayVersion"] == pin, path.name
    base = re.search(r"^ARG RAY_IMAGE=(\S+)", (CONFIGS / "Dockerfile").read_text(), re.M)
    assert base and base.group(1).startswith(f"rayproject/ray:{pin}-"), "Dockerfile's base image is not Ray " + pin
    for path in LAUNCHERS:
        docker = _load_yaml(path)["docker"]
        for key in ("image", "head_image", "worker_image"):
            if key in docker:
                assert docker[key].startswith(f"rayproject/ray:{pin}-"), f"{path.name}: docker.{key}"


# ---------------------------------------------------------------------------
# GCP cluster launcher
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _ray_schema() -> dict:
    import ray.autoscaler

    path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return json.loads(path.read_text())


def launcher_schema_errors(config: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(_ray_schema())
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(config)]


@pytest.mark.parametrize("path", LAUNCHERS, ids=_ids(LAUNCHERS))
def test_launcher_matches_ray_schema(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load_yaml(path)
    assert launcher_schema_errors(config) == []
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs


def launcher_problems(config: dict) -> list[str]:
    from ray._private.accelerators import TPUAcceleratorManager
    from ray._private.accelerators.tpu import _get_default_chips_per_vm, get_tpu_cores_per_chip

    problems = []
    provider = config.get("provider", {})
    if provider.get("type") != "gcp":
        problems.append("provider.type is not gcp")
    for key in ("project_id", "region", "availability_zone"):
        if not provider.get(key):
            problems.append(f"provider.{key} is missing")
    types = config.get("available_node_types", {})
    head = config.get("head_node_type")
    if head not in types:
        return problems + [f"head_node_type {head!r} is not in available_node_types"]
    if types[head]["resources"].get("CPU", None) != 0:
        problems.append("the head node type must advertise CPU 0: the driver's node must not host slices")
    workers = {k: v for k, v in types.items() if k != head}
    if sum(v.get("min_workers", 0) for v in workers.values()) > config.get("max_workers", 0):
        problems.append("max_workers is below the sum of min_workers")
    for name, node in workers.items():
        nc = node["node_config"]
        if "acceleratorType" in nc:
            accel = nc["acceleratorType"]
            if not TPUAcceleratorManager.is_valid_tpu_accelerator_type(accel):
                problems.append(f"{name}: acceleratorType {accel!r} is not a TPU type")
                continue
            if not nc.get("runtimeVersion"):
                problems.append(f"{name}: a TPU node needs runtimeVersion")
            version, cores = accel.rsplit("-", 1)
            chips = int(cores) // get_tpu_cores_per_chip(version)
            want = _get_default_chips_per_vm(f"1x{chips}", version)  # uses the chip count only
            if node["resources"].get("TPU") != want:
                problems.append(f"{name}: resources TPU {node['resources'].get('TPU')} != {want} chips per host")
            if "--privileged" not in (node.get("docker") or {}).get("worker_run_options", []) and config.get("docker"):
                problems.append(f"{name}: TPU hosts need --privileged in docker worker_run_options")
        else:
            if not node["resources"].get("GPU"):
                problems.append(f"{name}: a GPU node type needs resources GPU")
            if (nc.get("scheduling") or {}).get("onHostMaintenance") != "TERMINATE":
                problems.append(f"{name}: GPU VMs need scheduling.onHostMaintenance TERMINATE")
    mounts = config.get("file_mounts", {})
    if "." not in mounts.values():
        problems.append("file_mounts does not copy the repository ('.')")
    setup = " ".join(config.get("setup_commands", []) + config.get("worker_setup_commands", []))
    if "ray_elastic" not in setup:
        problems.append("no setup command installs ray_elastic")
    return problems


@pytest.mark.parametrize("path", LAUNCHERS, ids=_ids(LAUNCHERS))
def test_launcher_fits_the_trainer(path):
    assert launcher_problems(_load_yaml(path)) == []


def test_tpu_launcher_names_the_same_slice_as_the_manifest():
    from ray._private.accelerators.tpu import infer_tpu_pod_type_from_topology

    config = _load_yaml(CONFIGS / "gcp-launcher-tpu-v6e.yaml")
    (tpu,) = [v for v in config["available_node_types"].values() if "acceleratorType" in v["node_config"]]
    group = _load_yaml(CONFIGS / "raycluster-tpu-v6e.yaml")["spec"]["workerGroupSpecs"][0]
    topology = group["template"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR]
    assert tpu["node_config"]["acceleratorType"] == infer_tpu_pod_type_from_topology(topology, "v6e")
    assert tpu["min_workers"] == group["replicas"]


# ---------------------------------------------------------------------------
# Production settings: token authentication and node health checks
# ---------------------------------------------------------------------------

# Ray's settings for how fast the GCS declares a node dead, as RayConfig keys;
# on a head they are set as the environment variables RAY_<key>.
HEALTH_CHECK_KEYS = (
    "health_check_initial_delay_ms",
    "health_check_period_ms",
    "health_check_timeout_ms",
    "health_check_failure_threshold",
)


@functools.lru_cache(maxsize=None)
def _ray_config_defaults() -> dict[str, int]:
    """Ray's own defaults, read in a clean child process: this process's
    RayConfig takes the settings of any cluster started in it (the tests'
    LocalCluster sets tuned ones)."""
    import subprocess
    import sys

    code = (
        "import json; from ray._raylet import Config; "
        f"print(json.dumps({{k: int(getattr(Config, k)()) for k in {list(HEALTH_CHECK_KEYS)!r}}}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def health_check_problems(env: dict[str, Any], where: str) -> list[str]:
    """Problems of a head's health-check environment (`RAY_<key>` -> value).

    Every key set, to integers; at least as tolerant as the one-machine
    cluster the tests use (ray_elastic.cluster.local_cluster.FAST_FAILURE_DETECTION:
    a real network is slower, not faster); at least 2 misses in a row (one
    slow reply must never cost a slice); and a lost node declared dead
    sooner than with Ray's defaults, both a crashed one (threshold x period)
    and a silent one (threshold x (period + timeout))."""
    from ray_elastic.cluster.local_cluster import FAST_FAILURE_DETECTION

    values, problems = {}, []
    for key in HEALTH_CHECK_KEYS:
        raw = env.get(f"RAY_{key}")
        if raw is None:
            problems.append(f"{where}: RAY_{key} is not set")
            continue
        try:
            values[key] = int(str(raw))
        except ValueError:
            problems.append(f"{where}: RAY_{key}={raw!r} is not an integer")
    if problems:
        return problems
    for key, local in FAST_FAILURE_DETECTION.items():
        if key != "health_check_initial_delay_ms" and values[key] < local:
            problems.append(f"{where}: {key} {values[key]} is tighter than the local test cluster's {local}")
    if values["health_check_failure_threshold"] < 2:
        problems.append(f"{where}: health_check_failure_threshold must be >= 2 (one slow reply would kill a node)")

    def crashed(v):  # refused at once: threshold checks, period apart
        return v["health_check_failure_threshold"] * v["health_check_period_ms"]

    def silent(v):  # every check waits out its timeout
        return v["health_check_failure_threshold"] * (v["health_check_period_ms"] + v["health_check_timeout_ms"])

    defaults = _ray_config_defaults()
    for name, worst in (("crashed", crashed), ("silent", silent)):
        if worst(values) >= worst(defaults):
            problems.append(
                f"{where}: a {name} node is declared dead after ~{worst(values)} ms, "
                f"not sooner than with Ray's defaults (~{worst(defaults)} ms)"
            )
    return problems


def _container_env(container: dict) -> dict[str, Any]:
    """name -> value (or the valueFrom mapping) of a container's env."""
    return {e["name"]: e["value"] if "value" in e else e.get("valueFrom") for e in container.get("env") or []}


def _all_containers(pod_template: dict) -> list[dict]:
    spec = pod_template.get("spec") or {}
    return list(spec.get("containers") or []) + list(spec.get("initContainers") or [])


def auth_problems(manifest: dict) -> list[str]:
    """Token authentication of a RayCluster / RayJob manifest: on through
    `authOptions.mode: token` (KubeRay then generates the token's Secret and
    sets RAY_AUTH_MODE and RAY_AUTH_TOKEN on every Ray container), with no
    container turning it off (KubeRay keeps an env var a container already
    sets) and no token written into the manifest itself."""
    spec = _cluster_spec(manifest)
    problems = []
    mode = (spec.get("authOptions") or {}).get("mode")
    if mode != "token":
        problems.append(f"authOptions.mode is {mode!r}, not 'token': anyone who reaches the head can run code")
    pods = [("head", spec["headGroupSpec"]["template"])]
    pods += [(g.get("groupName", "?"), g["template"]) for g in spec.get("workerGroupSpecs") or []]
    if manifest["kind"] == "RayJob" and manifest["spec"].get("submitterPodTemplate"):
        pods.append(("submitter", manifest["spec"]["submitterPodTemplate"]))
    for where, pod in pods:
        for c in _all_containers(pod):
            env = _container_env(c)
            if "RAY_AUTH_MODE" in env and env["RAY_AUTH_MODE"] != "token":
                problems.append(f"{where}/{c.get('name')}: RAY_AUTH_MODE={env['RAY_AUTH_MODE']!r} turns authentication off")
            if isinstance(env.get("RAY_AUTH_TOKEN"), str):
                problems.append(f"{where}/{c.get('name')}: RAY_AUTH_TOKEN is written in the manifest; keep it in a Secret")
    return problems


def manifest_health_check_problems(manifest: dict) -> list[str]:
    head = _cluster_spec(manifest)["headGroupSpec"]["template"]
    ray_head = _containers(head)[0]  # KubeRay's Ray container is the first
    return health_check_problems(_container_env(ray_head), f"head container {ray_head.get('name')!r}")


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_manifest_has_token_auth(path):
    assert auth_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_manifest_head_sets_health_checks(path):
    assert manifest_health_check_problems(_load_yaml(path)) == []


_DOCKER_ENV = re.compile(r"^(?:--env|-e)[ =](\w+)=(\S*)$")


def _docker_env(options: list[str]) -> dict[str, str]:
    env = {}
    for option in options:
        m = _DOCKER_ENV.match(option.strip())
        if m:
            env[m.group(1)] = m.group(2)
    return env


def launcher_node_env(config: dict, node_type: str) -> dict[str, str] | None:
    """The environment `docker run` gives a node type's Ray container: the
    top-level `docker` section updated (shallowly, as the launcher does)
    with the node type's own, run_options plus head_ or worker_run_options.
    None when the config runs Ray without docker."""
    if "docker" not in config:
        return None
    docker = {**config["docker"], **(config["available_node_types"][node_type].get("docker") or {})}
    role = "head" if node_type == config["head_node_type"] else "worker"
    return _docker_env(list(docker.get("run_options") or []) + list(docker.get(f"{role}_run_options") or []))


def launcher_auth_problems(config: dict) -> list[str]:
    problems = []
    for node_type in config.get("available_node_types", {}):
        env = launcher_node_env(config, node_type)
        if env is None:
            return ["no docker section: this check reads RAY_AUTH_MODE from docker run options"]
        if env.get("RAY_AUTH_MODE") != "token":
            problems.append(f"{node_type}: its container does not get RAY_AUTH_MODE=token")
        if "RAY_AUTH_TOKEN" in env:
            problems.append(f"{node_type}: RAY_AUTH_TOKEN is written in the config; mount a token file instead")
    mounts = config.get("file_mounts") or {}
    token_paths = {"~/.ray/auth_token"} | {
        launcher_node_env(config, t).get("RAY_AUTH_TOKEN_PATH") for t in config.get("available_node_types", {})
    }
    if not token_paths & set(mounts):
        problems.append("file_mounts does not put the token on the nodes (~/.ray/auth_token or RAY_AUTH_TOKEN_PATH)")
    return problems


@pytest.mark.parametrize("path", LAUNCHERS, ids=_ids(LAUNCHERS))
def test_launcher_has_token_auth(path):
    assert launcher_auth_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", LAUNCHERS, ids=_ids(LAUNCHERS))
def test_launcher_head_sets_health_checks(path):
    config = _load_yaml(path)
    head = config["head_node_type"]
    assert health_check_problems(launcher_node_env(config, head) or {}, f"{head} container") == []


def test_every_config_sets_the_same_health_checks():
    """One tuning, stated once in the docs, everywhere."""
    seen = {}
    for path in MANIFESTS:
        env = _container_env(_containers(_cluster_spec(_load_yaml(path))["headGroupSpec"]["template"])[0])
        seen[path.name] = {k: str(env.get(f"RAY_{k}")) for k in HEALTH_CHECK_KEYS}
    for path in LAUNCHERS:
        config = _load_yaml(path)
        env = launcher_node_env(config, config["head_node_type"]) or {}
        seen[path.name] = {k: str(env.get(f"RAY_{k}")) for k in HEALTH_CHECK_KEYS}
    assert len({tuple(sorted(v.items())) for v in seen.values()}) == 1, seen


def test_health_check_variables_reach_ray():
    """The RAY_<key> names are Ray's own: a process started with them set
    reads them into its RayConfig (a misspelt one would be ignored
    silently)."""
    import subprocess
    import sys

    from ray._raylet import Config

    for key in HEALTH_CHECK_KEYS:
        assert callable(getattr(Config, key, None)), f"{key} is not a RayConfig key of this Ray"
    env = _container_env(_containers(_cluster_spec(_load_yaml(MANIFESTS[0]))["headGroupSpec"]["template"])[0])
    want = {k: int(env[f"RAY_{k}"]) for k in HEALTH_CHECK_KEYS}
    code = (
        "import json; from ray._raylet import Config; "
        f"print(json.dumps({{k: getattr(Config, k)() for k in {list(HEALTH_CHECK_KEYS)!r}}}))"
    )
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_health_check")}
    child_env.update({f"RAY_{k}": str(v) for k, v in want.items()})
    out = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want
    assert want != _ray_config_defaults()


# ---------------------------------------------------------------------------
# A lost driver: GCS fault tolerance, RayJob retries from durable checkpoints
# ---------------------------------------------------------------------------

# What KubeRay sets on the head from gcsFaultToleranceOptions, and rejects
# when a manifest sets it too (utils/validation.go, ValidateRayClusterSpec).
GCS_FT_OWNED_ENV = ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME", "RAY_external_storage_namespace")
GCS_FT_OWNED_PARAMS = ("redis-password", "redis-username")
GCS_FT_OWNED_ANNOTATIONS = ("ray.io/ft-enabled", "ray.io/external-storage-namespace")


def gcs_ft_problems(manifest: dict) -> list[str]:
    """GCS fault tolerance of a RayCluster / RayJob manifest: on, through
    `gcsFaultToleranceOptions` with an external Redis (so the worker pods
    survive a head restart), its password from a Secret, and none of what
    KubeRay then sets itself (and refuses to find set) set by hand."""
    spec = _cluster_spec(manifest)
    ft = spec.get("gcsFaultToleranceOptions")
    if not isinstance(ft, dict):
        return ["no gcsFaultToleranceOptions: a head restart takes the Ray of every worker pod down with it"]
    problems = []
    if ft.get("backend", "redis") != "redis":
        problems.append(
            f"gcsFaultToleranceOptions.backend {ft['backend']!r}: these configs use an external Redis "
            "(rocksdb needs KubeRay's GCSFaultToleranceEmbeddedStorage feature gate and a volume)"
        )
    address = ft.get("redisAddress")
    if not (isinstance(address, str) and re.fullmatch(r"(rediss?://)?[^\s:/,]+:\d+", address)):
        problems.append(f"gcsFaultToleranceOptions.redisAddress {address!r} is not host:port")
    for key in ("redisPassword", "redisUsername"):
        credential = ft.get(key)
        if credential is None:
            continue
        if "value" in credential or "secretKeyRef" not in (credential.get("valueFrom") or {}):
            problems.append(f"gcsFaultToleranceOptions.{key}: keep it in a Secret (valueFrom.secretKeyRef)")
    head = spec["headGroupSpec"]
    env = _container_env(_containers(head["template"])[0])
    for name in GCS_FT_OWNED_ENV:
        if name in env:
            problems.append(f"head container sets {name}: KubeRay sets it from gcsFaultToleranceOptions")
    for name in GCS_FT_OWNED_PARAMS:
        if name in (head.get("rayStartParams") or {}):
            problems.append(f"head rayStartParams sets {name}: KubeRay sets it from gcsFaultToleranceOptions")
    annotations = (manifest.get("metadata") or {}).get("annotations") or {}
    for name in GCS_FT_OWNED_ANNOTATIONS:
        if name in annotations:
            problems.append(f"annotation {name}: KubeRay refuses it next to gcsFaultToleranceOptions")
    return problems


def retry_problems(job: dict) -> list[str]:
    """A RayJob resubmits a lost driver (backoffLimit >= 1; each retry is a
    new RayCluster), and the new driver resumes: the entrypoint checkpoints
    to durable storage, which outlives the cluster."""
    spec = job["spec"]
    args = trainer_args(spec.get("entrypoint", ""))
    problems = []
    if not isinstance(spec.get("backoffLimit"), int) or spec["backoffLimit"] < 1:
        problems.append(
            f"backoffLimit {spec.get('backoffLimit')!r}: retries must be on, so a lost driver is resubmitted"
        )
    if not (args.checkpoint or "").startswith("gs://"):
        problems.append(f"--checkpoint {args.checkpoint!r}: a retry, on a new RayCluster, resumes only from gs://")
    if args.save_every is not None and args.save_every < 1:
        problems.append(f"--save-every {args.save_every} must be positive")
    return problems


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_manifest_has_gcs_fault_tolerance(path):
    assert gcs_ft_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", _files("rayjob-*.yaml"), ids=_ids(_files("rayjob-*.yaml")))
def test_rayjob_retries_from_durable_checkpoints(path):
    assert retry_problems(_load_yaml(path)) == []


def test_gcs_ft_comment_says_to_provide_the_redis():
    """The user must bring the Redis: every manifest says so next to the
    setting, with the Secret to create and what the setting is for."""
    for path in MANIFESTS:
        text = path.read_text()
        block = text[: text.index("gcsFaultToleranceOptions:")].rsplit("\n\n", 1)[-1]
        comment = block[block.rfind("# GCS fault tolerance") :]
        for needle in ("YOU MUST PROVIDE THE REDIS", "kubectl create secret", "survive", "--checkpoint"):
            assert needle in comment, f"{path.name}: the gcsFaultToleranceOptions comment does not say {needle!r}"
        assert "redisAddress:" in text and "# EDIT" in text.split("redisAddress:", 1)[1].splitlines()[0], path.name



# ---------------------------------------------------------------------------
# Docs
# ---------------------------------------------------------------------------


def test_readme_lists_every_config():
    readme = (CONFIGS / "README.md").read_text()
    for path in sorted(CONFIGS.iterdir()):
        if path.name != "README.md":
            assert f"`{path.name}`" in readme, f"cluster-configs/README.md does not list {path.name}"


def test_deploy_doc_names_the_trainer_and_the_manifests():
    doc = (ROOT / "docs" / "deploy-gke-kuberay.md").read_text()
    assert TRAINER in doc
    for path in MANIFESTS:
        assert path.name in doc, f"docs/deploy-gke-kuberay.md does not mention {path.name}"


def test_docs_say_how_clients_pass_the_token():
    for doc in (ROOT / "docs" / "deploy-gke-kuberay.md", CONFIGS / "README.md", ROOT / "README.md"):
        text = doc.read_text()
        for needle in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "~/.ray/auth_token", "authOptions",
                       "JobSubmissionClient", "Authorization", "RAY_health_check"):
            assert needle in text, f"{doc.relative_to(ROOT)} does not mention {needle}"


def test_docs_say_what_losing_the_head_means():
    doc = (ROOT / "docs" / "deploy-gke-kuberay.md").read_text()
    for needle in ("Losing the head node", "gcsFaultToleranceOptions", "redisAddress", "backoffLimit",
                   "resumed_from", "--checkpoint", "test_lost_driver_e2e.py"):
        assert needle in doc, f"docs/deploy-gke-kuberay.md does not mention {needle}"
    readme = (CONFIGS / "README.md").read_text()
    for needle in ("gcsFaultToleranceOptions", "Redis", "backoffLimit"):
        assert needle in readme, f"cluster-configs/README.md does not mention {needle}"


# ---------------------------------------------------------------------------
# 3. Negative tests: the validators do reject bad input
# ---------------------------------------------------------------------------


def _v6e_job() -> dict:
    return _load_yaml(CONFIGS / "rayjob-tpu-v6e.yaml")


def _worker(manifest: dict) -> dict:
    return _cluster_spec(manifest)["workerGroupSpecs"][0]


def _worker_container(manifest: dict) -> dict:
    return _worker(manifest)["template"]["spec"]["containers"][0]


def _rejects(manifest: dict, fragment: str) -> None:
    errors = schema_errors(manifest)
    assert errors, "the schema accepted a broken manifest"
    assert any(fragment in e for e in errors), errors


def test_schema_rejects_a_string_where_an_integer_is_required():
    job = _v6e_job()
    _worker(job)["replicas"] = "two"
    _rejects(job, "replicas: 'two' is not of type 'integer'")


def test_schema_rejects_an_unknown_field():
    job = _v6e_job()
    _worker(job)["numHosts"] = 4  # typo of numOfHosts: pruned silently without strict validation
    _rejects(job, "'numHosts' was unexpected")
    cluster = _load_yaml(CONFIGS / "raycluster-tpu-v6e.yaml")
    cluster["spec"]["entrypoint"] = "python examples/train_lm.py"  # a RayJob field on a RayCluster
    _rejects(cluster, "'entrypoint' was unexpected")


def test_schema_int_or_string_and_quantity_pattern():
    job = _v6e_job()
    limits = _worker_container(job)["resources"]["limits"]
    limits["google.com/tpu"] = 4  # an integer quantity is fine
    assert schema_errors(job) == []
    limits["memory"] = "lots"
    _rejects(job, "memory: 'lots' does not match")
    limits["memory"] = ["192Gi"]
    _rejects(job, "memory: ['192Gi'] is not valid under any of the given schemas")


def test_schema_rejects_int32_overflow_and_missing_required_field():
    job = _v6e_job()
    _worker(job)["numOfHosts"] = 2**31
    _rejects(job, "is not a 'int32'")
    job = _v6e_job()
    del _worker(job)["groupName"]
    _rejects(job, "'groupName' is a required property")


def test_schema_rejects_duplicate_list_map_keys():
    job = _v6e_job()
    containers = _worker(job)["template"]["spec"]["containers"]
    containers.append(copy.deepcopy(containers[0]))
    _rejects(job, "duplicate entry with {'name': 'ray-worker'}")


def test_schema_evaluates_cel_rules():
    job = _v6e_job()
    job["spec"]["managedBy"] = "someone-else"
    _rejects(job, "managedBy field value must be either")
    job["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert schema_errors(job) == []
    job["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}
    _rejects(job, "requires either BOTH onSuccess and onFailure")
    assert cel_rule_holds("size(self) > 1", "ab") is None  # outside the subset: reported, not passed


def test_metadata_name_rules():
    job = _v6e_job()
    job["metadata"]["name"] = "a" * 48
    _rejects(job, "longer than 47")
    job["metadata"]["name"] = "Ray_Elastic"
    _rejects(job, "DNS-1035")


def test_tpu_checks_catch_a_wrong_host_count():
    job = _v6e_job()
    _worker(job)["numOfHosts"] = 2
    problems = cluster_problems(job)
    assert any("chips x numOfHosts 2 = 8" in p for p in problems), problems
    assert any("TpuSlice reserves 4 hosts" in p for p in problems), problems


def test_tpu_checks_catch_wrong_chips_selectors_and_flags():
    job = _v6e_job()
    _worker_container(job)["resources"]["limits"]["google.com/tpu"] = "8"
    assert any("request 4 != limit 8" in p for p in cluster_problems(job))
    job = _v6e_job()
    del _worker(job)["template"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR]
    assert any(TOPOLOGY_SELECTOR in p for p in cluster_problems(job))
    job = _v6e_job()
    _worker(job)["template"]["spec"]["nodeSelector"][TOPOLOGY_SELECTOR] = "3x3"
    assert any("does not exist for TPU v6e" in p for p in cluster_problems(job))
    job = _v6e_job()
    job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace("--slices 2", "--slices 3")
    assert any("--slices 3 != 2" in p for p in cluster_problems(job))
    job = _v6e_job()
    job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace("--tpu-version v6e", "--tpu-version v5litepod")
    assert any("does not match nodeSelector 'tpu-v6e-slice'" in p for p in cluster_problems(job))
    job = _v6e_job()
    job["spec"]["entrypoint"] = "python -m ray_elastic.cli demo --slices 2"
    with pytest.raises(AssertionError, match="does not run examples/train_lm.py"):
        cluster_problems(job)


def test_cluster_checks_catch_a_head_that_hosts_slices_and_mixed_images():
    cluster = _load_yaml(CONFIGS / "raycluster-gpu-l4.yaml")
    cluster["spec"]["headGroupSpec"]["rayStartParams"] = {}
    _worker_container(cluster)["image"] = "rayproject/ray:2.60.0-py311-gpu"
    problems = cluster_problems(cluster)
    assert any("num-cpus" in p for p in problems), problems
    assert any("different images" in p for p in problems), problems


def test_auth_check_catches_auth_off():
    cluster = _load_yaml(CONFIGS / "raycluster-tpu-v6e.yaml")
    assert auth_problems(cluster) == []
    cluster["spec"]["authOptions"]["mode"] = "disabled"
    assert any("not 'token'" in p for p in auth_problems(cluster))
    del cluster["spec"]["authOptions"]
    assert any("not 'token'" in p for p in auth_problems(cluster))
    job = _v6e_job()
    del job["spec"]["rayClusterSpec"]["authOptions"]
    assert any("not 'token'" in p for p in auth_problems(job))
    job = _v6e_job()
    _worker_container(job)["env"] = [{"name": "RAY_AUTH_MODE", "value": "disabled"}]
    assert any("turns authentication off" in p for p in auth_problems(job))
    job = _v6e_job()
    _worker_container(job)["env"] = [{"name": "RAY_AUTH_TOKEN", "value": "0123abcd"}]
    assert any("keep it in a Secret" in p for p in auth_problems(job))
    _worker_container(job)["env"] = [
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "auth_token"}}}
    ]
    assert auth_problems(job) == []
    job = _v6e_job()
    job["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"  # the CRD's enum
    _rejects(job, "authOptions/mode: 'tokens' is not one of")


def test_health_check_check_catches_missing_and_default_values():
    job = _v6e_job()
    head = _containers(_cluster_spec(job)["headGroupSpec"]["template"])[0]
    assert manifest_health_check_problems(job) == []
    head["env"] = [e for e in head["env"] if e["name"] != "RAY_health_check_period_ms"]
    assert any("RAY_health_check_period_ms is not set" in p for p in manifest_health_check_problems(job))
    del head["env"]
    assert len(manifest_health_check_problems(job)) == len(HEALTH_CHECK_KEYS)
    defaults = {f"RAY_{k}": str(v) for k, v in _ray_config_defaults().items()}
    problems = health_check_problems(defaults, "head")
    assert any("a crashed node" in p and "not sooner" in p for p in problems), problems
    assert any("a silent node" in p for p in problems), problems
    tight = {f"RAY_{k}": "100" for k in HEALTH_CHECK_KEYS}
    tight["RAY_health_check_failure_threshold"] = "1"
    problems = health_check_problems(tight, "head")
    assert any("tighter than the local test cluster" in p for p in problems), problems
    assert any("must be >= 2" in p for p in problems), problems
    assert any("not an integer" in p for p in health_check_problems({**defaults, "RAY_health_check_period_ms": "1s"}, "h"))


def test_launcher_auth_and_health_checks_catch_omissions():
    config = _load_yaml(CONFIGS / "gcp-launcher-tpu-v6e.yaml")
    assert launcher_auth_problems(config) == []
    bad = copy.deepcopy(config)
    bad["docker"]["run_options"] = [o for o in bad["docker"]["run_options"] if "RAY_AUTH_MODE" not in o]
    problems = launcher_auth_problems(bad)
    assert sum("does not get RAY_AUTH_MODE=token" in p for p in problems) == 2, problems
    bad = copy.deepcopy(config)  # a node type's own run_options replace the top-level ones
    bad["available_node_types"]["tpu_v6e_4x4"]["docker"]["run_options"] = ["--shm-size=16g"]
    assert launcher_auth_problems(bad) == ["tpu_v6e_4x4: its container does not get RAY_AUTH_MODE=token"]
    bad = copy.deepcopy(config)
    del bad["file_mounts"]["~/.ray/auth_token"]
    assert any("does not put the token" in p for p in launcher_auth_problems(bad))
    bad = copy.deepcopy(config)
    bad["docker"]["run_options"].append("--env RAY_AUTH_TOKEN=0123abcd")
    assert any("written in the config" in p for p in launcher_auth_problems(bad))
    bad = copy.deepcopy(config)
    del bad["docker"]["head_run_options"]
    assert len(health_check_problems(launcher_node_env(bad, "head"), "head")) == len(HEALTH_CHECK_KEYS)
    # The worker's options never reach the head.
    bad["docker"]["worker_run_options"] = copy.deepcopy(config["docker"]["head_run_options"])
    assert health_check_problems(launcher_node_env(bad, "head"), "head")
    bad = copy.deepcopy(config)
    del bad["docker"]
    assert "no docker section" in launcher_auth_problems(bad)[0]


def test_launcher_validation_rejects_bad_configs():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load_yaml(CONFIGS / "gcp-launcher-gpu-l4.yaml")
    bad = copy.deepcopy(config)
    bad["max_workers"] = "two"
    assert any("max_workers" in e for e in launcher_schema_errors(bad))
    bad = copy.deepcopy(config)
    bad["setup_comands"] = []  # typo: the schema allows no unknown top-level keys
    assert any("setup_comands" in e for e in launcher_schema_errors(bad))
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))
    bad = copy.deepcopy(config)
    del bad["available_node_types"]["gpu_l4"]["node_config"]["scheduling"]
    assert any("onHostMaintenance" in p for p in launcher_problems(bad))
    tpu = _load_yaml(CONFIGS / "gcp-launcher-tpu-v6e.yaml")
    tpu["available_node_types"]["tpu_v6e_4x4"]["resources"]["TPU"] = 8
    assert any("resources TPU 8 != 4" in p for p in launcher_problems(tpu))


def test_gcs_ft_check_catches_omissions():
    cluster = _load_yaml(CONFIGS / "raycluster-tpu-v6e.yaml")
    assert gcs_ft_problems(cluster) == []
    bad = copy.deepcopy(cluster)
    del bad["spec"]["gcsFaultToleranceOptions"]
    assert any("no gcsFaultToleranceOptions" in p for p in gcs_ft_problems(bad))
    job = _v6e_job()
    del job["spec"]["rayClusterSpec"]["gcsFaultToleranceOptions"]
    assert any("no gcsFaultToleranceOptions" in p for p in gcs_ft_problems(job))
    bad = copy.deepcopy(cluster)
    bad["spec"]["gcsFaultToleranceOptions"]["redisPassword"] = {"value": "hunter2"}
    assert any("keep it in a Secret" in p for p in gcs_ft_problems(bad))
    bad = copy.deepcopy(cluster)
    bad["spec"]["gcsFaultToleranceOptions"]["redisAddress"] = ""
    assert any("is not host:port" in p for p in gcs_ft_problems(bad))
    bad = copy.deepcopy(cluster)
    bad["spec"]["gcsFaultToleranceOptions"]["backend"] = "rocksdb"
    assert any("backend 'rocksdb'" in p for p in gcs_ft_problems(bad))
    bad = copy.deepcopy(cluster)
    _containers(bad["spec"]["headGroupSpec"]["template"])[0]["env"].append({"name": "RAY_REDIS_ADDRESS", "value": "r:6379"})
    bad["spec"]["headGroupSpec"]["rayStartParams"]["redis-password"] = "$REDIS_PASSWORD"
    bad["metadata"]["annotations"] = {"ray.io/ft-enabled": "true"}
    problems = gcs_ft_problems(bad)
    assert len(problems) == 3 and all("KubeRay" in p for p in problems), problems
    # The schema holds the field names and the backend's values.
    bad = copy.deepcopy(cluster)
    ft = bad["spec"]["gcsFaultToleranceOptions"]
    ft["redisAdress"] = ft.pop("redisAddress")
    _rejects(bad, "'redisAdress' was unexpected")
    bad = copy.deepcopy(cluster)
    bad["spec"]["gcsFaultToleranceOptions"]["backend"] = "etcd"
    _rejects(bad, "backend: 'etcd' is not one of")
    bad = copy.deepcopy(cluster)
    bad["spec"]["gcsFaultToleranceOption"] = bad["spec"].pop("gcsFaultToleranceOptions")
    _rejects(bad, "'gcsFaultToleranceOption' was unexpected")


def test_retry_check_catches_no_retries_and_local_checkpoints():
    job = _v6e_job()
    assert retry_problems(job) == []
    job["spec"]["backoffLimit"] = 0
    assert any("retries must be on" in p for p in retry_problems(job))
    del job["spec"]["backoffLimit"]  # KubeRay's default is 0
    assert any("retries must be on" in p for p in retry_problems(job))
    job = _v6e_job()
    job["spec"]["entrypoint"] = re.sub(r"--checkpoint \S+", "--checkpoint /tmp/ckpt", job["spec"]["entrypoint"])
    assert any("resumes only from gs://" in p for p in retry_problems(job))
    job["spec"]["entrypoint"] = re.sub(r" --checkpoint \S+", "", job["spec"]["entrypoint"])
    assert any("--checkpoint None" in p for p in retry_problems(job))
    job = _v6e_job()
    job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace("--save-every 100", "--save-every 0")
    assert any("--save-every 0" in p for p in retry_problems(job))
