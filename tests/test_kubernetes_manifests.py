"""deploy/kubernetes: every manifest is a valid Kubernetes object (checked offline against the API's
schemas, strictly: an unknown field fails), every file is used by a kustomization, and the objects
keep pdserve's contract: routers probed on /ready, prefill and decode as StatefulSets whose pod
names are their instance ids and whose /dev/shm is memory large enough for the KV cache, a batch
worker reaching nothing but Redis, the Redis URL only ever from a Secret, a Redis that keeps the
Batch API's data (an append-only file on a claim of each pod's own, maxmemory with noeviction under
its memory limit), scrape annotations naming the port that serves metrics, and only PDSERVE_*
variables pdserve reads, with values its settings accept.

The kustomizations are rendered here by a small renderer of the features they use (resources,
patches of maps, images), so the checks run on what `kubectl apply -k` would send. Nothing reaches the network.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from pdserve.cli import build_parser
from pdserve.cli_commands import engine_config
from pdserve.flags import from_args
from pdserve.scheduler.redis_client import RedisSettings

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.37", "1.30")  # the newest schemas kubernetes-validate ships, and an older common one
COMPONENTS = {"router", "prefill", "decode", "batch-worker", "planner", "redis", "redis-sentinel"}
WORKLOADS = ("Deployment", "StatefulSet")
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
"""What the renderer below understands; a kustomization using more needs the renderer taught it."""
SECRET = ("pdserve-redis", "url")
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
KEDA_SCALED_OBJECT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": STRING_MAP, "annotations": STRING_MAP},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                **{
                    field: {"type": "integer", "minimum": 0}
                    for field in (
                        "pollingInterval",
                        "cooldownPeriod",
                        "initialCooldownPeriod",
                        "idleReplicaCount",
                        "minReplicaCount",
                        "maxReplicaCount",
                    )
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metadata": STRING_MAP,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
"""The fields of KEDA's ScaledObject (keda.sh/v1alpha1) these manifests may use, as KEDA documents
them, strictly: kubernetes-validate knows only the built-in kinds."""
METRICS_API = {"url", "format", "valueLocation", "targetValue", "activationTargetValue", "unsafeSsl"}
"""The metadata of KEDA's metrics-api trigger (without authentication)."""
POD_IP = "10.0.0.7"
Obj = dict[str, Any]


# ---- reading and rendering ----------------------------------------------------------------------
def documents(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


def kustomization(folder: Path) -> Obj:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def listed(folder: Path) -> Iterator[tuple[str, Path]]:
    """(field, path) of every file or folder one kustomization names."""
    k = kustomization(folder)
    for entry in k.get("resources", []):
        yield "resources", (folder / entry).resolve()
    for patch in k.get("patches", []):
        yield "patches", (folder / patch["path"]).resolve()


def merge(target: Obj, patch: Obj, where: str) -> None:
    """A strategic merge patch made of maps only (lists would need kustomize's merge keys)."""
    for key, value in patch.items():
        assert not isinstance(value, list), f"{where}: the test's renderer cannot merge the list {key!r}"
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value, f"{where}.{key}")
        else:
            target[key] = copy.deepcopy(value)


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def all_containers(obj: Obj) -> list[Obj]:
    spec = pod_spec(obj)
    return spec.get("initContainers", []) + spec["containers"]


def image_name(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def render(folder: Path) -> list[Obj]:
    """The objects `kubectl kustomize folder` prints (the features KUSTOMIZATION_FIELDS allows)."""
    k = kustomization(folder)
    assert set(k) <= KUSTOMIZATION_FIELDS, (
        f"{folder}: fields the test cannot render: {set(k) - KUSTOMIZATION_FIELDS}"
    )
    objects: list[Obj] = []
    for field, path in listed(folder):
        if field == "resources":
            objects += render(path) if path.is_dir() else documents(path)
    for field, path in listed(folder):
        if field == "patches":
            for patch in documents(path):
                key = (patch["kind"], patch["metadata"]["name"])
                targets = [o for o in objects if (o["kind"], o["metadata"]["name"]) == key]
                assert len(targets) == 1, f"{path}: patch of {key} matches {len(targets)} objects"
                merge(targets[0], patch, str(path))
    for image in k.get("images", []):
        for obj in objects:
            if obj["kind"] in WORKLOADS:
                for c in all_containers(obj):
                    if image_name(c["image"]) == image["name"]:
                        tag = image.get("newTag") or c["image"][len(image["name"]) + 1 :]
                        c["image"] = f"{image.get('newName', image['name'])}:{tag}"
    return objects


@dataclasses.dataclass
class Stack:
    """What one `kubectl apply -k` of a kustomization that no other one uses deploys."""

    folder: Path
    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.folder.relative_to(ROOT)}: {len(found)} {kind} named {name}"
        return found[0]

    def workload(self, component: str) -> Obj:
        (obj,) = [o for o in self.workloads() if component_of(o) == component]
        return obj

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in WORKLOADS]

    def pdserve_workloads(self) -> list[Obj]:
        return [o for o in self.workloads() if pdserve_container(o) is not None]

    def secret_value(self, name: str, key: str) -> str:
        secret = self.get("Secret", name)
        assert key in secret.get("stringData", {}), f"Secret {name} has no stringData key {key}"
        return secret["stringData"][key]


def root_folders() -> list[Path]:
    """The kustomizations no other one uses: each is one `kubectl apply -k`."""
    used = {path for folder in kustomization_dirs() for _, path in listed(folder)}
    return [folder for folder in kustomization_dirs() if folder.resolve() not in used]


@functools.cache
def stack_at(folder: Path) -> Stack:
    return Stack(folder, render(folder))


def stacks() -> list[Stack]:
    return [stack_at(folder) for folder in ROOTS]


def component_of(obj: Obj) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def pdserve_container(obj: Obj) -> Obj | None:
    """The container running pdserve in a workload (the image the Dockerfile builds)."""
    found = [c for c in pod_spec(obj)["containers"] if image_name(c["image"]).rsplit("/", 1)[-1] == "pdserve"]
    assert len(found) <= 1
    return found[0] if found else None


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (500m, 2, 256Mi, 1Gi, 1.5G) as a number."""
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    assert m and m[2] in {"", *suffixes}, f"not a quantity: {text!r}"
    return float(m[1]) * suffixes.get(m[2], 1)


def container_port(container: Obj, port: str | int) -> int:
    """The number of a declared containerPort, given by name or number."""
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"], str(p["containerPort"])):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def declares(container: Obj, port: str | int) -> bool:
    return any(port in (p.get("name"), p["containerPort"]) for p in container.get("ports", []))


def environment(stack: Stack, obj: Obj, container: Obj) -> dict[str, str]:
    """The container's variables as the kubelet would set them in the first pod."""
    out = {}
    for name, e in env_of(container).items():
        if "value" in e:
            out[name] = str(e["value"])
            continue
        source = e["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            out[name] = stack.secret_value(ref["name"], ref["key"])
        elif "fieldRef" in source:
            fields = {
                "metadata.name": f"{obj['metadata']['name']}-0",
                "metadata.namespace": "pdserve",
                "spec.nodeName": "node-1",
                "status.podIP": POD_IP,
                "status.hostIP": "192.168.0.10",
            }
            out[name] = fields[source["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref.get("containerName", container["name"]) == container["name"]
            kind, resource = ref["resource"].split(".")
            value = quantity(container["resources"][kind][resource]) / quantity(ref.get("divisor", "1"))
            out[name] = str(math.ceil(value))
        else:
            raise AssertionError(f"{name}: unknown valueFrom {source}")
    return out


ROOTS = root_folders()


def folder_id(folder: Path) -> str:
    return str(folder.relative_to(KUBE)) if folder != KUBE else "default"


def stack_id(stack: Stack) -> str:
    return folder_id(stack.folder)


@pytest.fixture(params=ROOTS, ids=folder_id)
def stack(request: pytest.FixtureRequest) -> Stack:
    return stack_at(request.param)


# ---- the files as Kubernetes and kustomize see them ---------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_a_valid_kubernetes_object(version: str) -> None:
    """Each document of each manifest (patches included: each is a whole object) against the API
    schemas of that version, strict: a misspelt or misplaced field fails."""
    checked, errors = 0, []
    for path in manifest_files():
        for doc in documents(path):
            where = f"{path.relative_to(KUBE)}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            assert "namespace" not in doc.get("metadata", {}), (
                f"{where} names a namespace: kustomize or -n sets it"
            )
            if doc.get("apiVersion", "").startswith("keda.sh/"):
                errors += [
                    f"{where}: {e.message}"
                    for e in jsonschema.Draft7Validator(KEDA_SCALED_OBJECT).iter_errors(doc)
                ]
                for trigger in doc.get("spec", {}).get("triggers", []):
                    if trigger.get("type") == "metrics-api" and set(trigger["metadata"]) - METRICS_API:
                        errors.append(
                            f"{where}: unknown metrics-api fields {set(trigger['metadata']) - METRICS_API}"
                        )
                checked += 1
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{where}: {e.message}")
            checked += 1
    assert not errors, "\n".join(errors)
    assert checked >= 10


def test_kustomizations_name_existing_files_and_every_manifest_is_used() -> None:
    used: set[Path] = set()
    for folder in kustomization_dirs():
        k = kustomization(folder)
        assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
        assert set(k) <= KUSTOMIZATION_FIELDS, f"{folder}: {set(k) - KUSTOMIZATION_FIELDS}"
        for field, path in listed(folder):
            where = f"{folder.relative_to(ROOT)}/kustomization.yaml {field}: {path}"
            assert path.is_relative_to(KUBE), f"{where} is outside deploy/kubernetes"
            if path.is_dir():
                assert field == "resources" and (path / "kustomization.yaml").is_file(), f"{where}"
            else:
                assert path.is_file() and path.suffix == ".yaml", f"{where} does not exist"
            used.add(path)
    forgotten = [str(p.relative_to(KUBE)) for p in manifest_files() if p.resolve() not in used]
    assert not forgotten, f"manifests no kustomization lists: {forgotten}"
    assert {folder_id(f) for f in ROOTS} == {"default", "redis-sentinel", "planner"}


# ---- pdserve's contract -------------------------------------------------------------------------
def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_objects_are_labelled_and_every_selector_selects(stack: Stack) -> None:
    for obj in stack.objects:
        labels = obj["metadata"].get("labels", {})
        where = f"{obj['kind']} {obj['metadata']['name']}"
        assert labels.get("app.kubernetes.io/name") == "pdserve", where
        assert labels.get("app.kubernetes.io/component") in COMPONENTS, where
    templates = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in stack.workloads()
    }
    for obj in stack.workloads():
        name, template = obj["metadata"]["name"], templates[obj["metadata"]["name"]]
        assert selects(obj["spec"]["selector"]["matchLabels"], template), name
        assert template.get("app.kubernetes.io/component") == component_of(obj), name
        # one workload per selector: two selecting the same pods would fight over them
        others = [
            n
            for n, t in templates.items()
            if n != name and selects(obj["spec"]["selector"]["matchLabels"], t)
        ]
        assert not others, f"{name}'s selector also selects {others}"
    for svc in stack.of_kind("Service"):
        chosen = [n for n, t in templates.items() if selects(svc["spec"]["selector"], t)]
        assert len(chosen) == 1, f"Service {svc['metadata']['name']} selects {chosen}"
        workload = next(o for o in stack.workloads() if o["metadata"]["name"] == chosen[0])
        for port in svc["spec"]["ports"]:
            assert any(declares(c, port["targetPort"]) for c in pod_spec(workload)["containers"]), port
    for sts in stack.of_kind("StatefulSet"):
        svc = stack.get("Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", (
            f"StatefulSet {sts['metadata']['name']}: headless Service"
        )
        assert selects(svc["spec"]["selector"], templates[sts["metadata"]["name"]])
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in stack.of_kind(kind):
            selector = obj["spec"].get("selector") or obj["spec"]["podSelector"]
            chosen = [n for n, t in templates.items() if selector_matches(selector, t)]
            assert chosen, f"{kind} {obj['metadata']['name']} selects no pods"


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and In expressions) against a pod's labels."""
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", "the test knows only In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_router_is_probed_on_ready_and_health_routes_it_serves(stack: Stack) -> None:
    """Readiness is /ready (Redis answers and a decode instance is live), liveness /health (the
    process), both on the port the router listens on, and both GET routes of the router app."""
    from pdserve.router.http.app import create_app
    from pdserve.router.http.settings import RouterSettings

    router = stack.workload("router")
    assert router["kind"] == "Deployment"
    container = pdserve_container(router)
    assert container is not None and container["args"][0] == "router"
    env = environment(stack, router, container)
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert ready["path"] == "/ready"
    assert live["path"] == "/health"
    for probe in (ready, live):
        assert container_port(container, probe["port"]) == int(env["PDSERVE_PORT"])
    assert env["PDSERVE_HOST"] not in ("127.0.0.1", "localhost", "::1"), "the kubelet probes the pod's IP"
    app = create_app(RouterSettings())
    routes = {(getattr(r, "path", ""), m) for r in app.routes for m in getattr(r, "methods", ())}
    assert {(ready["path"], "GET"), (live["path"], "GET")} <= routes


def test_router_autoscaler_targets_the_router_deployment(stack: Stack) -> None:
    (hpa,) = stack.of_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    router = stack.workload("router")
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        router["apiVersion"],
        router["kind"],
        router["metadata"]["name"],
    )
    assert hpa["spec"]["minReplicas"] >= 2
    # A replica count in the Deployment would undo the autoscaler's at every `kubectl apply`.
    assert "replicas" not in router["spec"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # Utilization is relative to the request, so the router must request CPU.
    container = pdserve_container(router)
    assert container is not None and quantity(container["resources"]["requests"]["cpu"]) > 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_are_statefulsets_with_a_memory_dev_shm(stack: Stack, role: str) -> None:
    """A decode instance's KV cache is a segment in /dev/shm committed at start (the worker exits if
    it does not fit), and tmpfs pages count against the container's memory limit."""
    worker = stack.workload(role)
    assert worker["kind"] == "StatefulSet"
    container = pdserve_container(worker)
    assert container is not None and container["args"][0] == "worker"
    env = environment(stack, worker, container)
    assert env["PDSERVE_ROLE"] == role
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod_spec(worker)["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = quantity(volume["emptyDir"]["sizeLimit"])
    memory_limit = quantity(container["resources"]["limits"]["memory"])
    assert shm <= memory_limit
    if role == "decode":
        kv = quantity(env["PDSERVE_KV_CACHE_GB"]) * 2**30
        assert shm >= kv, f"/dev/shm {shm / 2**20:.0f} MiB cannot hold the {kv / 2**20:.0f} MiB KV cache"
        assert memory_limit >= kv + 1 * 2**30, "the limit covers the cache in /dev/shm and ~1 GiB besides"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_identity_and_transfer_address_come_from_the_pod(stack: Stack, role: str) -> None:
    """Stable instance ids from the StatefulSet's pod names; one host identity per pod (pods share
    no /dev/shm, so the router must not pair two pods through shm); KV over Mooncake at the pod IP;
    readiness from `pdserve status --check` of that same instance id."""
    worker = stack.workload(role)
    container = pdserve_container(worker)
    assert container is not None
    env = env_of(container)

    def field(name: str) -> str:
        return env[name]["valueFrom"]["fieldRef"]["fieldPath"]

    assert field("PDSERVE_INSTANCE_ID") == "metadata.name"
    assert field("PDSERVE_HOSTNAME") == "metadata.name"
    assert field("PDSERVE_TRANSFER_ADDRESS") == "status.podIP"
    assert env["PDSERVE_KV_TRANSFER"]["value"] == "mooncake"
    threads = env["PDSERVE_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert threads["resource"] == "limits.cpu" and threads["containerName"] == container["name"]

    (shell, flag, script) = container["readinessProbe"]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")
    argv = shlex.split(script)
    assert argv[:2] == ["exec", "pdserve"], script
    args = build_parser().parse_args(argv[2:])
    assert args.command == "status" and args.check == "$PDSERVE_INSTANCE_ID"  # sh expands it


def template_labels(obj: Obj) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def policies_of(stack: Stack, labels: dict[str, str], policy_type: str) -> list[Obj]:
    """The NetworkPolicies of that type selecting pods with these labels."""
    return [
        p
        for p in stack.of_kind("NetworkPolicy")
        if selector_matches(p["spec"]["podSelector"], labels) and policy_type in p["spec"]["policyTypes"]
    ]


def admits(rule: Obj, labels: dict[str, str]) -> bool:
    """Whether an ingress rule lets pods with these labels (in the namespace) in."""
    peers = rule.get("from")
    return not peers or any(
        set(peer) == {"podSelector"} and selector_matches(peer["podSelector"], labels) for peer in peers
    )


def compose_grace_s(service: str) -> int:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    m = re.fullmatch(r"(\d+)s", str(compose["services"][service]["stop_grace_period"]))
    assert m, compose["services"][service]["stop_grace_period"]
    return int(m[1])


def test_batch_worker_is_a_deployment_reading_redis_from_the_secret(stack: Stack) -> None:
    """`pdserve batch-worker` in base and so in every stack: one replica of the routers' image, the
    routers' Redis URL from the Secret (the Sentinels' in the overlay; rq cannot use a Cluster), at
    least compose's grace period for rq's warm shutdown, no probe that Redis would fail, no Service,
    and a new rq name at each container start (rq refuses a name it still counts alive)."""
    worker = stack.workload("batch-worker")
    assert worker["kind"] == "Deployment" and worker["spec"]["replicas"] == 1
    container = pdserve_container(worker)
    assert container is not None and container["args"] == ["batch-worker"]
    router = stack.workload("router")
    router_container = pdserve_container(router)
    assert router_container is not None and container["image"] == router_container["image"]

    ref = env_of(container)["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == SECRET
    url = environment(stack, worker, container)["PDSERVE_REDIS_URL"]
    assert url == environment(stack, router, router_container)["PDSERVE_REDIS_URL"]
    mode = RedisSettings.from_url(url).mode
    assert mode != "cluster", "rq has no Redis Cluster support"
    if stack.folder == KUBE / "redis-sentinel":
        assert mode == "sentinel" and url == stack.secret_value(*SECRET)
        assert url != stack_at(KUBE).secret_value(*SECRET), "the overlay's URL replaces the placeholder"

    spec = pod_spec(worker)
    assert spec["terminationGracePeriodSeconds"] >= compose_grace_s("batch-worker")
    probes = [p for p in ("livenessProbe", "readinessProbe", "startupProbe") if p in container]
    assert not probes, f"{probes}: nothing checks a batch worker's health, and Redis outages must not kill it"
    for kind in ("cpu", "memory"):
        requests, limits = container["resources"]["requests"][kind], container["resources"]["limits"][kind]
        assert 0 < quantity(requests) <= quantity(limits), kind
    services = [
        s["metadata"]["name"]
        for s in stack.of_kind("Service")
        if selects(s["spec"]["selector"], template_labels(worker))
    ]
    assert not services, f"nothing connects to a batch worker, yet {services} select it"


def test_batch_worker_network_reaches_only_redis(stack: Stack) -> None:
    """Into a batch worker: only its metrics port. Into prefill and decode pods from it: only their
    metrics port (it reaches them through Redis). Out of it, where the stack deploys the Redis: the
    Redis and Sentinel pods on their ports and DNS, nothing else; and Redis admits it."""
    worker = stack.workload("batch-worker")
    labels = template_labels(worker)
    container = pdserve_container(worker)
    assert container is not None
    metrics = int(environment(stack, worker, container)["PDSERVE_METRICS_PORT"])

    ingress = policies_of(stack, labels, "Ingress")
    assert ingress, "no NetworkPolicy limits what connects to the batch worker"
    for rule in (r for p in ingress for r in p["spec"].get("ingress", [])):
        assert rule.get("ports"), f"an ingress rule admits every port: {rule}"
        assert {container_port(container, p["port"]) for p in rule["ports"]} == {metrics}, rule
    for role in ("prefill", "decode"):
        target = stack.workload(role)
        target_container = pdserve_container(target)
        assert target_container is not None
        target_metrics = int(environment(stack, target, target_container)["PDSERVE_METRICS_PORT"])
        for rule in (
            r for p in policies_of(stack, template_labels(target), "Ingress") for r in p["spec"]["ingress"]
        ):
            if admits(rule, labels):
                ports = {container_port(target_container, p["port"]) for p in rule.get("ports", [])}
                assert ports == {target_metrics}, f"{role} admits the batch worker beyond metrics: {rule}"

    components = {component_of(o): o for o in stack.workloads()}
    egress = policies_of(stack, labels, "Egress")
    if "redis" not in components:  # a Redis of your own: wherever the Secret says, so not restricted
        assert not egress
        return
    assert egress, "the stack deploys the Redis, yet the batch worker may reach anything"
    reached = set()
    for rule in (r for p in egress for r in p["spec"].get("egress", [])):
        assert rule.get("ports"), f"egress to every port: {rule}"
        ports = {(p["port"], p.get("protocol", "TCP")) for p in rule["ports"]}
        if "to" not in rule:
            assert ports == {(53, "UDP"), (53, "TCP")}, f"egress to anywhere but for DNS: {rule}"
            continue
        for peer in rule["to"]:
            assert set(peer) == {"podSelector"}, peer
            (component,) = [
                c for c, o in components.items() if selector_matches(peer["podSelector"], template_labels(o))
            ]
            assert component in ("redis", "redis-sentinel"), f"the batch worker reaches {component}"
            (target,) = pod_spec(components[component])["containers"]
            assert {(container_port(target, p), proto) for p, proto in ports} == {
                (int(p["containerPort"]), "TCP") for p in target["ports"]
            }, rule
            reached.add(component)
    assert reached == {"redis", "redis-sentinel"}
    for component in reached:
        rules = [
            r
            for p in policies_of(stack, template_labels(components[component]), "Ingress")
            for r in p["spec"]["ingress"]
        ]
        assert any(admits(r, labels) for r in rules), f"{component} does not admit the batch worker"


def pdserve_containers() -> Iterator[tuple[Stack, Obj, Obj]]:
    for stack in stacks():
        for obj in stack.pdserve_workloads():
            container = pdserve_container(obj)
            assert container is not None
            yield stack, obj, container


REDIS_URL = re.compile(r"(redis|rediss|unix|redis\+\w+)://", re.I)


def test_redis_url_comes_from_the_secret_in_every_pdserve_container() -> None:
    """The URL may hold a password: never a literal in a manifest, never on a command line."""
    seen = 0
    for stack, obj, container in pdserve_containers():
        where = f"{stack_id(stack)}: {obj['metadata']['name']}"
        ref = env_of(container)["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == SECRET, where
        RedisSettings.from_url(stack.secret_value(*SECRET))  # a URL pdserve can use
        seen += 1
    for stack in stacks():
        for obj in stack.workloads():
            for c in all_containers(obj):
                argv = [*c.get("command", []), *c.get("args", [])]
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    argv += c.get(probe, {}).get("exec", {}).get("command", [])
                assert not any("--redis-url" in a or REDIS_URL.search(a) for a in argv), (
                    obj["metadata"],
                    argv,
                )
                literal = [e["name"] for e in c.get("env", []) if REDIS_URL.search(str(e.get("value", "")))]
                assert not literal, f"{obj['metadata']['name']}: Redis URL as a literal in {literal}"
    # router, prefill, decode, batch-worker, and the planner where it runs
    assert seen == 4 * len(ROOTS) + sum(1 for stack in stacks() if stack.of_kind("ScaledObject"))


def test_sentinel_stack_points_pdserve_at_its_sentinels() -> None:
    """The Secret's URL lists exactly the Sentinel pods by their DNS names and the name they monitor
    the primary under; the Sentinels and the Redis pods agree on names and ports."""
    stack = stack_at(KUBE / "redis-sentinel")
    url = RedisSettings.from_url(stack.secret_value(*SECRET))
    assert url.mode == "sentinel"
    sentinels, redis = stack.workload("redis-sentinel"), stack.workload("redis")
    assert sentinels["spec"]["replicas"] == 3 and redis["spec"]["replicas"] == 2
    for obj in (sentinels, redis):
        assert {c["image"] for c in all_containers(obj)} == {"redis:7.4"}

    def dns(sts: Obj, i: int) -> str:
        return f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"

    sentinel_port = container_port(pod_spec(sentinels)["containers"][0], "sentinel")
    expected = {(dns(sentinels, i), sentinel_port) for i in range(sentinels["spec"]["replicas"])}
    assert set(url.nodes) == expected

    (config,) = stack.of_kind("ConfigMap")
    data = config["data"]
    monitor = re.search(r"^sentinel monitor (\S+) @PRIMARY@ (\d+) (\d+)$", data["sentinel.conf"], re.M)
    assert monitor, data["sentinel.conf"]
    assert monitor[1] == url.service_name
    assert int(monitor[2]) == container_port(pod_spec(redis)["containers"][0], "redis")
    assert sentinels["spec"]["replicas"] // 2 < int(monitor[3]) <= sentinels["spec"]["replicas"]  # a majority
    peers = "for i in " + " ".join(str(i) for i in range(sentinels["spec"]["replicas"]))
    for script in ("init-redis.sh", "init-sentinel.sh"):
        text = data[script]
        assert f'primary="{dns(redis, 0)}"' in text and peers in text, script
        assert f"get-master-addr-by-name {url.service_name}" in text, script
        assert subprocess.run(["sh", "-n"], input=text, text=True, check=False).returncode == 0, script
    # every file a container runs from the ConfigMap's volume is in the ConfigMap
    for obj in (sentinels, redis):
        (volume,) = [v for v in pod_spec(obj)["volumes"] if v.get("configMap")]
        assert volume["configMap"]["name"] == config["metadata"]["name"]
        for c in all_containers(obj):
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for arg in c["command"]:
                folder, _, name = arg.rpartition("/")
                if mounts.get(folder) == volume["name"]:
                    assert name in data, (
                        f"{obj['metadata']['name']}/{c['name']} runs {arg}, not in the ConfigMap"
                    )


def redis_bytes(text: str) -> int:
    """A Redis memory size (``1536mb``, ``2gb``, ``100m``, ``1048576``) in bytes, as Redis reads it."""
    units = {"": 1, "k": 1000, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}
    m = re.fullmatch(r"(\d+)([a-z]*)", text.lower())
    assert m and m[2] in units, f"not a Redis memory size: {text!r}"
    return int(m[1]) * units[m[2]]


def test_redis_keeps_batch_data_on_a_claim_of_its_own_within_its_memory_limit() -> None:
    """The Batch API keeps files, batch records and line outcomes in Redis for 30 days, so each
    Redis pod logs every write (AOF, fsynced every second) to /data on a PersistentVolumeClaim of its
    own, and has a maxmemory with noeviction (a full Redis refuses writes rather than drop keys)
    that holds at least one full-size batch (input, outcomes, output: 3 x the upload limit) and
    stays under the container's memory limit with room for a fork's copies and an upload."""
    from pdserve.batchstore.file_object import DEFAULT_MAX_FILE_BYTES

    stack = stack_at(KUBE / "redis-sentinel")
    redis = stack.workload("redis")
    (config,) = stack.of_kind("ConfigMap")
    conf: dict[str, str] = {}
    for line in config["data"]["redis.conf"].splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.strip().partition(" ")
            conf[name] = value.strip()
    assert conf.get("appendonly") == "yes" and conf.get("appendfsync") == "everysec", conf
    assert conf.get("maxmemory-policy") == "noeviction", conf
    assert conf.get("dir") == "/data", conf
    max_file = DEFAULT_MAX_FILE_BYTES
    for obj in stack.pdserve_workloads():  # the largest upload a router or batch worker takes
        pdserve = pdserve_container(obj)
        assert pdserve is not None
        value = environment(stack, obj, pdserve).get("PDSERVE_MAX_FILE_BYTES")
        max_file = max(max_file, int(value)) if value else max_file
    maxmemory = redis_bytes(conf.get("maxmemory", "0"))
    assert maxmemory >= 3 * max_file, f"maxmemory {maxmemory} holds no full-size batch"
    (container,) = [c for c in pod_spec(redis)["containers"] if c["name"] == "redis"]
    limit = quantity(container["resources"]["limits"]["memory"])
    assert 2 * maxmemory + max_file <= limit, (
        f"maxmemory {maxmemory}: a fork's copies and an upload do not fit in the limit {limit}"
    )
    assert quantity(container["resources"]["requests"]["memory"]) >= maxmemory
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"]: c for c in redis["spec"].get("volumeClaimTemplates", [])}
    assert mounts.get("/data") in claims, f"/data is {mounts.get('/data')}, not a claim of the pod's own"
    assert mounts["/data"] not in {v["name"] for v in pod_spec(redis)["volumes"]}  # not an emptyDir
    claim = claims[mounts["/data"]]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"]
    # the AOF grows to twice the data between rewrites (auto-aof-rewrite-percentage 100), and a
    # rewrite writes a new base beside it
    assert quantity(claim["resources"]["requests"]["storage"]) >= 3 * maxmemory


def test_pdserve_pods_are_scraped_on_the_port_serving_metrics() -> None:
    for stack, obj, container in pdserve_containers():
        where = f"{stack_id(stack)}: {obj['metadata']['name']}"
        notes = obj["spec"]["template"]["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", where
        assert notes.get("prometheus.io/path") == "/metrics", where
        port = container_port(container, int(notes["prometheus.io/port"]))
        env = environment(stack, obj, container)
        if container["args"][0] == "router":  # /metrics on its HTTP port
            assert port == int(env["PDSERVE_PORT"]), where
            assert env.get("PDSERVE_METRICS", "true") in ("1", "true", "yes", "on"), where
        elif container["args"][0] == "batch-worker":  # its metrics server, on all interfaces
            assert port == int(env["PDSERVE_METRICS_PORT"]), where
        else:  # the worker's own metrics server, off unless given a port
            assert port == int(env["PDSERVE_METRICS_PORT"]), where
            assert env["PDSERVE_METRICS_HOST"] in ("0.0.0.0", "::"), where


def pdserve_reads() -> set[str]:
    """PDSERVE_* variables read outside argparse (e.g. PDSERVE_CACHE_DIR), found in the source."""
    found: set[str] = set()
    for path in (ROOT / "pdserve").rglob("*.py"):
        found |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["'](PDSERVE_\w+)["']""", path.read_text()))
    return found


def subcommand(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def variables_of(command: str) -> set[str]:
    parser = build_parser()
    helps = [a.help or "" for a in [*parser._actions, *subcommand(parser, command)._actions]]
    return {v for h in helps for v in re.findall(r"\[env (PDSERVE_\w+)\]", h)}


def test_pdserve_reads_every_variable_the_manifests_set() -> None:
    """A variable pdserve does not read is a setting silently lost (e.g. PDSERVE_INSTANCEID)."""
    extra = pdserve_reads()
    assert "PDSERVE_CACHE_DIR" in extra
    for stack, obj, container in pdserve_containers():
        known = variables_of(container["args"][0]) | extra
        unknown = sorted(n for n in env_of(container) if n.startswith("PDSERVE_") and n not in known)
        assert not unknown, (
            f"{stack_id(stack)}: {obj['metadata']['name']} sets {unknown}, which pdserve never reads"
        )
        # No Service links: a Service named `pdserve` would otherwise set PDSERVE_PORT=tcp://...
        assert pod_spec(obj).get("enableServiceLinks") is False, obj["metadata"]["name"]


def test_each_pdserve_container_environment_makes_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the container's command would build from its variables: flags' types and choices, and
    the settings' own checks (the image's entrypoint is `pdserve`)."""
    from pdserve.batch.settings import BatchWorkerSettings
    from pdserve.router.http.settings import settings_from_args
    from pdserve.worker.settings import WorkerSettings

    for stack, obj, container in pdserve_containers():
        with monkeypatch.context() as m:
            for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
                m.delenv(name)
            variables = environment(stack, obj, container)
            for name, value in variables.items():
                m.setenv(name, value)
            parser = build_parser()
            args = parser.parse_args(container["args"])
            for action in subcommand(parser, args.command)._actions:  # argparse checks no default
                given = getattr(args, action.dest, None)
                if action.choices is not None and given is not None:
                    assert given in action.choices, f"{obj['metadata']['name']}: {action.dest}={given!r}"
            if args.command == "router":
                settings: Any = settings_from_args(args)
            elif args.command == "batch-worker":
                # the batch worker's own flags and the router's it uses, from the variables alone
                assert container["args"] == ["batch-worker"], obj["metadata"]["name"]
                own = argparse.ArgumentParser()
                BatchWorkerSettings.add_arguments(own)
                batch = BatchWorkerSettings.from_args(own.parse_args([]))
                assert batch.metrics_port == int(variables["PDSERVE_METRICS_PORT"])
                settings = batch.router
            elif args.command == "plan":
                from pdserve.planner.settings import PlanSettings

                settings = from_args(PlanSettings, args)
            else:
                settings = from_args(WorkerSettings, args, engine=engine_config(args))
                assert settings.instance_id == settings.host == f"{obj['metadata']['name']}-0"
                assert settings.transfer_address == POD_IP
            RedisSettings.from_url(settings.redis_url)


def test_the_planner_switches_roles_and_keda_scales_its_pool_by_its_endpoint() -> None:
    """deploy/kubernetes/planner: one planner (Recreate: never two switching at once) applying its
    decisions; KEDA's ScaledObject scales a StatefulSet whose pods can all take any role (they start
    as decode instances) to the count the planner's /desired says, read from the planner's Service
    on the port it listens on; the planner's most instances are that pool's most plus the pods that
    cannot switch, so it never asks for more than KEDA may start."""
    from pdserve.planner.endpoint import desired_view
    from pdserve.planner.records import Decision
    from pdserve.planner.settings import PlanSettings

    stack = stack_at(KUBE / "planner")
    planner = stack.workload("planner")
    assert planner["kind"] == "Deployment" and planner["spec"]["replicas"] == 1
    assert planner["spec"]["strategy"]["type"] == "Recreate"
    container = pdserve_container(planner)
    assert container is not None and container["args"] == ["plan"]
    env = environment(stack, planner, container)
    assert env["PDSERVE_APPLY"] in ("1", "true") and env["PDSERVE_METRICS_HOST"] == "0.0.0.0"

    (scaled,) = stack.of_kind("ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    pool = stack.get(target["kind"], target["name"])
    assert (target["apiVersion"], target["kind"]) == (pool["apiVersion"], "StatefulSet")
    pool_container = pdserve_container(pool)
    assert pool_container is not None
    pool_env = environment(stack, pool, pool_container)
    assert pool_env["PDSERVE_ROLE"] == "decode" or pool_env.get("PDSERVE_SWITCHABLE") in ("1", "true"), (
        "KEDA's pool must be instances able to take any role"
    )
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metadata"].get("format", "json") == "json"
    url = httpx.URL(trigger["metadata"]["url"])
    service = stack.get("Service", url.host)
    assert selects(service["spec"]["selector"], template_labels(planner))
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert container_port(container, port["targetPort"]) == int(env["PDSERVE_METRICS_PORT"])
    assert url.path == "/desired"
    decision = Decision(
        0.0, "hold", "", {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, inputs={"unswitchable": 1}
    )
    view = desired_view(decision)
    assert isinstance(view.get(trigger["metadata"]["valueLocation"]), int), "KEDA reads a number there"
    assert (
        float(trigger["metadata"]["targetValue"]) == 1
        and trigger.get("metricType", "AverageValue") == "AverageValue"
    )

    fixed = sum(
        o["spec"].get("replicas", 1)
        for o in stack.of_kind("StatefulSet")
        if o is not pool and component_of(o) in ("prefill", "decode")
    )
    settings = PlanSettings(
        max_instances=int(env["PDSERVE_MAX_INSTANCES"]), min_instances=int(env["PDSERVE_MIN_INSTANCES"])
    )
    assert settings.max_instances == scaled["spec"]["maxReplicaCount"] + fixed
    assert settings.min_instances <= scaled["spec"]["minReplicaCount"] + fixed
