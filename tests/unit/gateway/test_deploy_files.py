"""deploy/: the Kubernetes manifests and the compose file against the Kubernetes API, the image and
the settings the gateway reads.

The manifests are validated offline against the strict JSON schemas (no unknown field) of the
Kubernetes version docs/deployment.md names, shipped by `kubernetes-validate`. The environment each file
gives the gateway, on top of what deploy/Dockerfile sets, must name only variables
gateway/settings.py reads and docs/configuration.md lists, and must load as settings in keys mode.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway.settings import Settings

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = DEPLOY / "docker-compose.yaml"


def kubernetes_version() -> str:
    """The version the deployment page names: "... against the API of Kubernetes 1.NN ..."."""
    found = re.search(r"API of Kubernetes (1\.\d+)", (REPO / "docs" / "deployment.md").read_text(encoding="utf-8"))
    assert found, "docs/deployment.md names no Kubernetes version ('API of Kubernetes 1.NN') for deploy/k8s"
    return found.group(1) + ".0"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in K8S_FILES:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                docs.append((f"{path.name}#{i}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc))
    return docs


def image_env() -> dict[str, str]:
    """ENV of deploy/Dockerfile's final stage (what every container of the image starts with)."""
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    final = re.split(r"^FROM\s", text, flags=re.M)[-1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value.replace("$PATH", "/usr/bin")
    return env


def settings_variables() -> set[str]:
    """TIERLANE_* names gateway/settings.py reads (the only module that reads the environment)."""
    return set(re.findall(r"\"(TIERLANE_[A-Z_]+)\"", (REPO / "gateway" / "settings.py").read_text(encoding="utf-8")))


def documented_variables() -> set[str]:
    """TIERLANE_* names the configuration page's environment table lists."""
    return set(re.findall(r"`(TIERLANE_[A-Z_]+)`", (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")))


def sidecar() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(pod spec, app container, tierlane container) of the Deployment that carries the sidecar."""
    for _, doc in manifests():
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            by_name = {c["name"]: c for c in spec["containers"]}
            if "tierlane" in by_name:
                (app,) = [c for name, c in by_name.items() if name != "tierlane"]
                return spec, app, by_name["tierlane"]
    raise AssertionError("no Deployment in deploy/k8s has a `tierlane` container")


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's env; a value from a Secret stands as `<secret/key>`."""
    out = {}
    for item in container.get("env", []):
        if "value" in item:
            out[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            out[item["name"]] = f"<{ref['name']}/{ref['key']}>"
    return out


def load_settings(env: dict[str, str], keys_path: str, tmp_path: Path) -> Settings:
    """The settings the gateway would load from this environment; the mounted keys file is a temporary one,
    and so is the config file a ConfigMap of the sidecar manifest mounts at TIERLANE_CONFIG."""
    keys = tmp_path / "keys.yaml"
    keys.write_text('- {sha256: "' + "0" * 64 + '", tenant: my-llm-app}\n')
    assert env["TIERLANE_API_KEYS_FILE"] == keys_path
    env = {**env, "TIERLANE_API_KEYS_FILE": str(keys)}
    if "TIERLANE_CONFIG" in env:
        config = tmp_path / "tierlane.yaml"
        config.write_text(mounted_config(env["TIERLANE_CONFIG"]), encoding="utf-8")
        env["TIERLANE_CONFIG"] = str(config)
    return Settings.load(env=env)


def mounted_config(path: str) -> str:
    """The text of the ConfigMap key the sidecar's tierlane container mounts at `path`."""
    spec, _, gateway = sidecar()
    mount = next(m for m in gateway["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])["configMap"]
    item = next(i for i in volume["items"] if f"{mount['mountPath']}/{i['path']}" == path)
    config_maps = {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == "ConfigMap"}
    return str(config_maps[volume["name"]]["data"][item["key"]])


@pytest.mark.parametrize("name,doc", manifests(), ids=[n for n, _ in manifests()])
def test_every_manifest_names_only_fields_of_its_kinds_api(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, kubernetes_version(), strict=True)


def test_the_validation_catches_an_unknown_field() -> None:
    _, doc = next((n, d) for n, d in manifests() if d["kind"] == "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"paht": "/readyz", "port": 8080}}
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(doc, kubernetes_version(), strict=True)


def test_the_sidecar_shares_the_app_pod_network_on_loopback_with_keys_on(tmp_path: Path) -> None:
    spec, app, gateway = sidecar()
    assert not spec.get("hostNetwork"), "the sidecar and the app share the pod's own network namespace"
    env = {**image_env(), **plain_env(gateway)}
    settings = load_settings(env, next(v for v in env.values() if v.startswith("/etc/tierlane/keys/")), tmp_path)
    assert settings.auth.mode == "keys" and settings.auth.keys, "keys mode, with the mounted keys file"
    port = settings.server.port
    base = urlsplit(plain_env(app)["OPENAI_BASE_URL"])
    assert (base.hostname, base.port, base.path) == ("127.0.0.1", port, "/v1"), "the app talks to the sidecar over loopback"
    # The app's key and the digests the gateway accepts come from the same Secret.
    keys_volume = next(m for m in gateway["volumeMounts"] if env["TIERLANE_API_KEYS_FILE"].startswith(m["mountPath"] + "/"))
    assert keys_volume.get("readOnly") is True
    secret = next(v for v in spec["volumes"] if v["name"] == keys_volume["name"])["secret"]
    assert plain_env(app)["OPENAI_API_KEY"] == f"<{secret['secretName']}/app-key>"
    assert [i["path"] for i in secret["items"]] == [Path(env["TIERLANE_API_KEYS_FILE"]).name]
    state = next(m for m in gateway["volumeMounts"] if m["mountPath"] == env["TIERLANE_STATE_DIR"])
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == state["name"])
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    # The shared store is the Service this directory defines, on the port it exposes.
    store = urlsplit(settings.state.url or "")
    services = {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == "Service"}
    assert settings.state.backend == "redis" and store.hostname in services
    assert store.port in [p["port"] for p in services[str(store.hostname)]["spec"]["ports"]]


def test_the_sidecar_edge_model_is_a_file_on_a_read_only_volume_the_pod_mounts(tmp_path: Path) -> None:
    spec, _, gateway = sidecar()
    env = {**image_env(), **plain_env(gateway)}
    edge = load_settings(env, env["TIERLANE_API_KEYS_FILE"], tmp_path).edge
    assert edge.enabled and edge.hub_file is None, "the gateway reads the model from the volume, never downloads it"
    mount = next(m for m in gateway["volumeMounts"] if edge.model.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True and edge.model.endswith(".gguf")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    claims = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "PersistentVolumeClaim"}
    assert volume["persistentVolumeClaim"]["claimName"] in claims
    # the gateway image's own layers carry no model choice: it comes from the mounted config
    assert not {k for k in image_env() if k.startswith("TIERLANE_EDGE_MODEL")}


def test_the_variables_of_the_manifests_are_ones_the_gateway_reads() -> None:
    _, _, gateway = sidecar()
    named = {k for k in plain_env(gateway) if k.startswith("TIERLANE_")} | {k for k in image_env() if k.startswith("TIERLANE_")}
    assert named <= settings_variables(), f"not read by gateway/settings.py: {sorted(named - settings_variables())}"
    assert named <= documented_variables(), f"not in docs/configuration.md's environment table: {sorted(named - documented_variables())}"
    upstream_key = plain_env(gateway).get("TIERLANE_UPSTREAM_API_KEY_ENV")
    assert upstream_key is None or upstream_key in plain_env(gateway)


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text(encoding="utf-8")))


def gateway_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if svc.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}


def compose_env(svc: dict[str, Any]) -> dict[str, str]:
    """A service's environment with `${VAR:-default}` as its default (an empty one: a stand-in URL or key)."""
    out = {}
    for key, value in svc["environment"].items():
        value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", lambda m: m.group(1), str(value))
        out[key] = value or {"TIERLANE_UPSTREAM_URL": "http://upstream.example:8000/v1"}.get(key, "stand-in")
    return out


def test_the_compose_gateways_load_as_settings_in_keys_mode(tmp_path: Path) -> None:
    services = compose()["services"]
    gateways = gateway_services()
    assert len(gateways) == 2, "two replicas built from deploy/Dockerfile"
    for name, svc in gateways.items():
        env = {**image_env(), **compose_env(svc)}
        (secret,) = svc["secrets"]
        assert env["TIERLANE_API_KEYS_FILE"] == f"/run/secrets/{secret}", "the keys file is the compose secret"
        assert secret in compose()["secrets"]
        settings = load_settings(env, f"/run/secrets/{secret}", tmp_path)
        assert (settings.auth.mode, settings.server.host) == ("keys", "0.0.0.0")
        assert settings.state.backend == "redis" and urlsplit(settings.state.url or "").hostname in services
        assert [u.api_key for u in settings.upstreams] == ["stand-in"], "the upstream key is read from the variable it names"
        assert [v.split(":")[1] for v in svc["volumes"]] == [env["TIERLANE_STATE_DIR"]], "each replica keeps its ledger in a volume"
        assert urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).hostname in services
        named = {k for k in env if k.startswith("TIERLANE_")}
        assert named <= settings_variables(), f"{name}: not read by gateway/settings.py: {sorted(named - settings_variables())}"
        assert named <= documented_variables(), (
            f"{name}: not in docs/configuration.md's environment table: {sorted(named - documented_variables())}"
        )


def test_nginx_and_prometheus_reach_each_compose_replica_on_the_gateway_port() -> None:
    port = int(image_env()["TIERLANE_PORT"])
    replicas = {f"{name}:{port}" for name in gateway_services()}
    nginx = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    assert set(re.findall(r"^\s*server\s+([\w.-]+:\d+)", nginx, flags=re.M)) == replicas
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yaml").read_text(encoding="utf-8"))
    (job,) = prometheus["scrape_configs"]
    assert {t for c in job["static_configs"] for t in c["targets"]} == replicas
    assert job["authorization"]["credentials_file"] == "/run/secrets/tierlane-metrics-key"
    assert "tierlane-metrics-key" in compose()["services"]["prometheus"]["secrets"]


def test_the_wheel_carries_every_data_file_of_the_packages() -> None:
    """The image installs the built wheel, not the checkout: a data file that pyproject's
    package-data misses is absent there although an editable install finds it."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    globs = {pkg: patterns for pkg, patterns in yaml.safe_load(section.replace(" = ", ": ")).items()}
    shipped = {p for pkg, patterns in globs.items() for pattern in patterns for p in (REPO / pkg).glob(pattern) if p.is_file()}
    data = {
        p
        for pkg in ("gateway", "edge_engine", "policies", "telemetry")
        for p in (REPO / pkg).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in p.parts
    }
    assert not sorted(str(p.relative_to(REPO)) for p in data - shipped)


def test_the_shipped_valkey_has_a_memory_bound_below_its_container_limit() -> None:
    """Past maxmemory Valkey refuses writes (noeviction: spend is never silently evicted), which the
    gateway treats as a store outage; without it the container is killed at its memory limit."""
    for _, doc in manifests():
        if doc.get("kind") == "Deployment" and doc["metadata"]["name"] == "tierlane-valkey":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            args = container["args"]
            assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
            maxmemory = args[args.index("--maxmemory") + 1]
            assert maxmemory.endswith("mb") and int(maxmemory[:-2]) * 2**20 < 2**30  # the container's 1Gi limit
            assert container["resources"]["limits"]["memory"] == "1Gi"
            break
    else:
        raise AssertionError("no tierlane-valkey Deployment in deploy/k8s")
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text(encoding="utf-8"))
    command = next(s["command"] for s in compose["services"].values() if s.get("command", [""])[0] == "valkey-server")
    assert "--maxmemory" in command and command[command.index("--maxmemory-policy") + 1] == "noeviction"
