"""deploy/kubernetes: rendered as kustomize would, every object valid against the schemas.

Validation is offline (``kubernetes-validate`` ships the schemas); the cross-object
checks are what a schema cannot see: selectors that match, the router's ``dns:`` peers
naming the headless Services, the Secret every pod mounts, probes on real endpoints.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from mlxcel_plugin.cli import make_parser
from mlxcel_plugin.discovery_api import DiscoveryConfig, parse_dns_entry
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link.protocol.secret import ClusterSecret, parse_secret_text

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
PROBE_PATHS = {"/health/ready", "/health/live"}


def render(root: Path = MANIFESTS) -> list[dict]:
    """The kustomization's resources with its ``labels`` pairs applied (what kustomize does)."""
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    objects = []
    for resource in kustomization["resources"]:
        for document in yaml.safe_load_all((root / resource).read_text()):
            objects.append(copy.deepcopy(document))
    for label_set in kustomization.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    return objects


OBJECTS = render()


def by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == kind}


def container_args(deployment: dict) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_validates_against_the_kubernetes_schema(obj):
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validation_catches_a_misspelt_field():
    deployment = copy.deepcopy(by_kind("Deployment")["mlxcel-router"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_objects_the_issue_asks_for_are_there():
    kinds = {(o["kind"], o["metadata"]["name"]) for o in OBJECTS}
    for role in ("router", "prefill", "decode"):
        assert ("Deployment", f"mlxcel-{role}") in kinds
        assert ("Service", f"mlxcel-{role}") in kinds
        assert ("PodDisruptionBudget", f"mlxcel-{role}") in kinds
    assert ("Secret", "mlxcel-cluster-secret") in kinds


def test_selectors_of_services_and_budgets_match_their_deployments_pods():
    deployments = by_kind("Deployment")
    for kind in ("Service", "PodDisruptionBudget"):
        for name, obj in by_kind(kind).items():
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= pod_labels.items(), f"{kind}/{name} selects no pod"


def test_the_router_finds_the_pools_through_their_headless_services():
    services = by_kind("Service")
    args = container_args(by_kind("Deployment")["mlxcel-router"])
    for role in ("prefill", "decode"):
        name, port = parse_dns_entry(args[f"{role}-peers"])
        service = services[name]
        assert service["spec"]["clusterIP"] == "None"
        assert port in [p["port"] for p in service["spec"]["ports"]]
        node_args = container_args(by_kind("Deployment")[name])
        assert node_args["serving-bind"].endswith(f":{port}")


def test_pool_pods_carry_the_lws_role_labels_the_kubernetes_source_reads():
    role_label = DiscoveryConfig().kubernetes_role_label
    for role in ("prefill", "decode"):
        template = by_kind("Deployment")[f"mlxcel-{role}"]["spec"]["template"]
        assert template["metadata"]["labels"][role_label] == role
        ports = template["spec"]["containers"][0]["ports"]
        assert DiscoveryConfig().kubernetes_port_name in [p["name"] for p in ports]


def test_every_pod_mounts_the_cluster_secret_it_is_told_to_read():
    secret = next(iter(by_kind("Secret")))
    for name, deployment in by_kind("Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        container = spec["containers"][0]
        secret_file = Path(container_args(deployment)["cluster-secret-file"])
        mount = next(m for m in container["volumeMounts"]
                     if Path(m["mountPath"]) == secret_file.parent)
        assert volumes[mount["name"]]["secret"]["secretName"] == secret, name
        assert secret_file.name in by_kind("Secret")[secret]["stringData"]


def test_containers_have_probes_on_health_endpoints_and_resources():
    for name, deployment in by_kind("Deployment").items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"]["path"] in PROBE_PATHS, (name, probe)
        assert container["resources"]["requests"]["memory"], name


def test_container_args_are_flags_the_cli_knows():
    parser = make_parser()
    for deployment in by_kind("Deployment").values():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        parser.parse_args(container["args"])  # exits (SystemExit) on an unknown flag


def test_the_shipped_secret_is_too_short_to_run_a_cluster():
    value = by_kind("Secret")["mlxcel-cluster-secret"]["stringData"]["cluster.secret"]
    with pytest.raises(ConfigError, match="needs at least"):
        ClusterSecret(parse_secret_text(value.encode()))
