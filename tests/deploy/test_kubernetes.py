"""The Kubernetes manifests (deploy/kubernetes/), checked without a cluster: each object against the
Kubernetes API schemas (kubernetes-validate ships them), then the references between objects that no
schema sees (labels and selectors, ports, ConfigMap and Secret names and keys, mounted files), and the
configuration file read the way the gateway reads it: every key a `serve` option, the whole accepted by
the same checks `serve` runs before it binds its port, with the Secret's files where the pod mounts them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from harmony_gateway.cli import build_parser, invalid_setting, settings_from_args
from harmony_gateway.routing.dns_discovery import parse_dns_target
from tests.deploy.kit import (
    DOCKERFILE,
    KUBERNETES,
    require_module,
    serve_options,
)

#: The oldest Kubernetes release the manifests are checked against, besides the newest the package knows.
OLDEST_KUBERNETES = "1.28.0"
CONFIG_FLAG = "--config"
#: The configuration file option: given on the container's command line, it is the one flag the kit
#: passes that the ConfigMap cannot hold.
APP = "harmony-gateway"

Object = dict[str, Any]


def kustomization() -> Object:
    loaded: Object = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return loaded


def kit() -> dict[tuple[str, str], Object]:
    """The objects of the kit, by (kind, name)."""
    objects: dict[tuple[str, str], Object] = {}
    for resource in kustomization()["resources"]:
        for document in yaml.safe_load_all((KUBERNETES / resource).read_text()):
            key = (document["kind"], document["metadata"]["name"])
            assert key not in objects, key
            objects[key] = document
    return objects


def gateway() -> Object:
    return kit()[("Deployment", APP)]


def pod(deployment: Object) -> Object:
    spec: Object = deployment["spec"]["template"]["spec"]
    return spec


def container(deployment: Object) -> Object:
    (only,) = pod(deployment)["containers"]
    return only


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def config_file() -> dict[str, Any]:
    data = kit()[("ConfigMap", "harmony-gateway-config")]["data"]
    loaded: dict[str, Any] = yaml.safe_load(data["config.yaml"])
    return loaded


def mounted_files(deployment: Object) -> dict[str, tuple[str, str, str]]:
    """Every file the pod mounts from a ConfigMap or Secret: path → (kind, object name, key)."""
    volumes = {v["name"]: v for v in pod(deployment)["volumes"]}
    files: dict[str, tuple[str, str, str]] = {}
    for mount in container(deployment)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = ("ConfigMap", volume["configMap"]["name"], volume["configMap"].get("items"))
        elif "secret" in volume:
            source = ("Secret", volume["secret"]["secretName"], volume["secret"].get("items"))
        else:
            continue
        kind, name, items = source
        assert items, f"volume {mount['name']}: list its items, so each file is a key that exists"
        for item in items:
            files[f"{mount['mountPath']}/{item['path']}"] = (kind, name, item["key"])
    return files


def object_data(kind: str, name: str) -> dict[str, str]:
    found = kit()[(kind, name)]
    data: dict[str, str] = found.get("data") or found.get("stringData") or {}
    return data


def test_the_kustomization_lists_every_manifest_once() -> None:
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(
        p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    assert len(set(listed)) == len(listed)
    (image,) = kustomization()["images"]
    assert container(gateway())["image"] == image["name"]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "newest"])
def test_every_object_is_valid_against_the_kubernetes_api_schemas(version: str) -> None:
    validate = require_module("kubernetes_validate")
    target = validate.latest_version() if version == "newest" else version
    for key, document in kit().items():
        try:
            validate.validate(document, target, strict=True)
        except validate.ValidationError as exc:
            pytest.fail(f"{key} is not a valid Kubernetes {target} object: {exc.message}")


def test_labels_and_selectors_agree() -> None:
    objects = kit()
    deployment = gateway()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    service = objects[("Service", APP)]
    assert selects(service["spec"]["selector"], labels)
    budget = objects[("PodDisruptionBudget", APP)]
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    for spread in pod(deployment)["topologySpreadConstraints"]:
        assert selects(spread["labelSelector"]["matchLabels"], labels)
    engines = objects[("Service", "engines")]
    assert not selects(engines["spec"]["selector"], labels)  # the engines' Service never picks gateways


def test_ports_and_probes_agree() -> None:
    deployment = gateway()
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}

    def port_of(reference: str | int) -> int:
        if isinstance(reference, int):
            assert reference in ports.values(), reference
            return reference
        assert reference in ports, reference
        return ports[reference]

    service = kit()[("Service", APP)]
    for service_port in service["spec"]["ports"]:
        port_of(service_port["targetPort"])
    probes = {
        name: container(deployment)[name]["httpGet"]
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert {name: probe["path"] for name, probe in probes.items()} == {
        "startupProbe": "/health",
        "livenessProbe": "/health",
        "readinessProbe": "/readiness",
    }
    (http,) = {port_of(probe["port"]) for probe in probes.values()}
    # The gateway listens where the probes, the Service and the scrape annotation look.
    assert config_file()["port"] == http
    assert int(deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == http
    exposed = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("EXPOSE ")]
    assert exposed == [str(http)]


def test_configmap_and_secret_references_agree() -> None:
    deployment = gateway()
    volumes = {v["name"] for v in pod(deployment)["volumes"]}
    assert {m["name"] for m in container(deployment)["volumeMounts"]} == volumes
    for path, (kind, name, key) in mounted_files(deployment).items():
        assert key in object_data(kind, name), (path, kind, name, key)
    for variable in container(deployment)["env"]:
        reference = variable["valueFrom"]["secretKeyRef"]
        assert reference["key"] in object_data("Secret", reference["name"]), variable["name"]
    args = container(deployment)["args"]
    assert args[0] == CONFIG_FLAG and mounted_files(deployment)[args[1]][0] == "ConfigMap"
    # Every file the configuration names is one the pod mounts.
    options = serve_options()
    for key, value in config_file().items():
        if isinstance(value, str) and value.startswith("/"):
            assert options[key].metavar in (None, "FILE", "PATH"), key
            assert value in mounted_files(deployment), (key, value)


def test_the_command_line_names_only_serve_options() -> None:
    options = set(serve_options())
    flags = [a for a in container(gateway())["args"] if a.startswith("--")]
    assert set(flags) <= {f"--{o}" for o in options}
    assert set(config_file()) <= options, set(config_file()) - options


def test_the_config_file_is_accepted_by_serve_with_the_pod_files_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = gateway()
    files = mounted_files(deployment)
    # The pod's files, under tmp_path; the configuration's paths moved there with them.
    for path, (kind, name, key) in files.items():
        local = tmp_path / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(object_data(kind, name)[key])
    config = {
        key: str(tmp_path / value.lstrip("/")) if isinstance(value, str) and value in files else value
        for key, value in config_file().items()
    }
    secret = object_data("Secret", "harmony-gateway-keys")
    for variable in container(deployment)["env"]:
        monkeypatch.setenv(variable["name"], secret[variable["valueFrom"]["secretKeyRef"]["key"]])
    for variable in (
        "HARMONY_GATEWAY_API_KEY",
        "HARMONY_GATEWAY_API_KEYS",
        "HARMONY_GATEWAY_KEY",
        "HARMONY_GATEWAY_REASONING_KEY",
        "HARMONY_MODELS",
        "HARMONY_GATEWAY_CONFIG",
    ):
        monkeypatch.delenv(variable, raising=False)

    # Read as the gateway reads it: `serve --config FILE`, with the pod's environment.
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = build_parser().parse_args(["serve", "--config", str(config_path)])
    settings = settings_from_args(args)
    assert invalid_setting(settings) is None
    # What the Secret holds reaches the settings.
    keys = [line.split()[0] for line in secret["api-keys"].splitlines() if line.strip()]
    assert settings.api_keys == frozenset(keys)
    assert {p.tenant for p in settings.key_policies.values()} == {"team-a", "team-b"}
    assert settings.admin_keys == frozenset({secret["admin-keys"]})
    assert settings.reasoning_key == secret["reasoning-key"].strip()
    # Several replicas share their state: PostgreSQL for storage, Redis for the rate-limit budgets.
    assert deployment["spec"]["replicas"] > 1
    assert settings.storage_url and settings.storage_url.startswith("postgresql://")
    assert settings.rate_limit_store and settings.rate_limit_store.startswith("redis://")
    assert ":" not in (settings.storage_url.split("@")[0].split("//")[1]), (
        "the password comes from PGPASSWORD"
    )
    assert settings.processes == 1  # one process a pod: replicas scale it (docs/operations.md)
    # The drain fits in the pod's grace period, after the preStop pause.
    pause = int(container(deployment)["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod(deployment)["terminationGracePeriodSeconds"] > settings.drain_timeout + pause
    assert settings.host == "0.0.0.0"


def test_dns_discovery_names_the_headless_engines_service() -> None:
    engines = kit()[("Service", "engines")]
    assert engines["spec"]["clusterIP"] == "None"
    (grpc,) = engines["spec"]["ports"]
    namespace = kustomization()["namespace"]
    (spec,) = config_file()["worker-dns"]
    target = parse_dns_target(spec)
    assert target.name == f"engines.{namespace}.svc.cluster.local"
    assert target.port == grpc["port"]


def test_the_pod_runs_as_the_image_user_with_a_read_only_root() -> None:
    deployment = gateway()
    security = pod(deployment)["securityContext"]
    user = next(line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER "))
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == user
    assert security["runAsNonRoot"] is True
    container_security = container(deployment)["securityContext"]
    assert container_security["readOnlyRootFilesystem"] is True
    assert container_security["allowPrivilegeEscalation"] is False
    assert container_security["capabilities"]["drop"] == ["ALL"]
    # What the gateway writes at run time (temporary files) has a volume of its own.
    assert "/tmp" in {m["mountPath"] for m in container(deployment)["volumeMounts"]}
    assert json.dumps(pod(deployment)).count("hostPath") == 0
