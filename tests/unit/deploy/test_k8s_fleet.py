"""deploy/k8s/fleet/: the gateway fleet, Valkey and the llama.cpp upstreams, checked offline (no cluster).

Every manifest under deploy/k8s/ (the fleet and the sidecar) is validated against the strict JSON
schemas (no unknown field) of the Kubernetes version docs/deployment.md names, as shipped inside
`kubernetes-validate`. The gateway config the ConfigMap mounts is loaded the way the container
loads it: the image's environment, the file through TIERLANE_CONFIG, the Deployment's variables
(Secret values as stand-ins, `$(VAR)` expanded as the kubelet does), by the gateway's own loader;
then the objects are checked against each other: selectors, probe routes, Secret keys, the upstream
members against the server StatefulSet, the store URL against the Valkey Service.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from redis.connection import parse_url

from gateway.app import create_app, load_policy
from gateway.middleware import UNAUTHENTICATED
from gateway.settings import Settings, read_keys_file
from policies.pricing import Pricing
from tests.unit.gateway.test_deploy_files import image_env

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
FLEET = K8S / "fleet"
SECRET_TEMPLATE = FLEET / "secret.yaml.example"
SIDECAR = K8S / "sidecar.yaml"
BENCH = REPO / "bench" / "results"

Doc = dict[str, Any]


def kubernetes_version() -> str:
    """The version the deployment page names ("... against the API of Kubernetes 1.NN ..."), as the sidecar's test reads it."""
    found = re.search(r"API of Kubernetes (1\.\d+)", (REPO / "docs" / "deployment.md").read_text(encoding="utf-8"))
    assert found, "docs/deployment.md names no Kubernetes version ('API of Kubernetes 1.NN') for deploy/k8s"
    return found.group(1) + ".0"


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def all_manifests() -> list[tuple[str, Doc]]:
    """Every object kubectl would apply from deploy/k8s/ (recursively), plus the Secret template."""
    out = []
    for path in [*sorted(K8S.rglob("*.yaml")), SECRET_TEMPLATE]:
        for i, doc in enumerate(load_docs(path)):
            out.append((f"{path.relative_to(K8S)}#{i}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc))
    return out


def fleet() -> dict[tuple[str, str], Doc]:
    """The fleet's objects by (kind, name); the template Secret is not one of them."""
    objects: dict[tuple[str, str], Doc] = {}
    for path in sorted(FLEET.glob("*.yaml")):
        for doc in load_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice in deploy/k8s/fleet"
            objects[key] = doc
    return objects


def template_secret() -> Doc:
    (secret,) = load_docs(SECRET_TEMPLATE)
    assert secret["kind"] == "Secret"
    return secret


def pod_spec(workload: Doc) -> Doc:
    return dict(workload["spec"]["template"]["spec"])


def pod_labels(workload: Doc) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def gateway() -> tuple[Doc, Doc]:
    """(Deployment, its gateway container)."""
    deployment = fleet()[("Deployment", "tierlane")]
    (container,) = pod_spec(deployment)["containers"]
    return deployment, container


def only(kind: str) -> Doc:
    (doc,) = [d for (k, _), d in fleet().items() if k == kind]
    return doc


def stand_in(key: str) -> str:
    """A Secret value for the tests: URL-safe, as the template asks the real ones to be."""
    return re.sub(r"[^a-z0-9]", "", key.lower()) + "0123456789abcdef"


def container_env(container: Doc) -> dict[str, str]:
    """The container's variables as the kubelet gives them: Secret values as stand-ins, `$(VAR)` of an
    earlier variable expanded (`$$` escapes), an unknown reference left as written."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:

            def expand(m: re.Match[str]) -> str:
                return "$(" + m.group(2) + ")" if m.group(1) else env.get(m.group(2), m.group(0))

            env[item["name"]] = re.sub(r"(\$?)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = stand_in(ref["key"])
    return env


def mounted_file(container: Doc, pod: Doc, path: str) -> tuple[Doc, Doc]:
    """(volume mount, volume) that `path` lies in."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return mount, volume


def gateway_settings(tmp_path: Path) -> tuple[Settings, dict[str, str]]:
    """The settings the fleet's gateway container starts with, loaded by the gateway's loader."""
    deployment, container = gateway()
    pod = pod_spec(deployment)
    env = {**image_env(), **container_env(container)}
    # The config file: the ConfigMap key the volume mounts at TIERLANE_CONFIG, written to a temp file.
    mount, volume = mounted_file(container, pod, env["TIERLANE_CONFIG"])
    (item,) = volume["configMap"]["items"]
    assert env["TIERLANE_CONFIG"] == f"{mount['mountPath']}/{item['path']}"
    config_map = fleet()[("ConfigMap", volume["configMap"]["name"])]
    config = tmp_path / "tierlane.yaml"
    config.write_text(config_map["data"][item["key"]], encoding="utf-8")
    # The keys file: the Secret's keys.yaml at TIERLANE_API_KEYS_FILE; here a list of one digest.
    mount, volume = mounted_file(container, pod, env["TIERLANE_API_KEYS_FILE"])
    (item,) = volume["secret"]["items"]
    assert env["TIERLANE_API_KEYS_FILE"] == f"{mount['mountPath']}/{item['path']}" and mount.get("readOnly") is True
    keys = tmp_path / "keys.yaml"
    keys.write_text('- {sha256: "' + "0" * 64 + '", tenant: my-app}\n', encoding="utf-8")
    env = {**env, "TIERLANE_CONFIG": str(config), "TIERLANE_API_KEYS_FILE": str(keys)}
    return Settings.load(env=env), env


def resource_quantity(value: str) -> float:
    """A Kubernetes quantity ("2", "250m", "1Gi", "768Mi") as a number (cores or bytes)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    found = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert found, value
    return float(found.group(1)) * units.get(found.group(2), 1)


# -- 1. the schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,doc", all_manifests(), ids=[n for n, _ in all_manifests()])
def test_every_manifest_validates_strictly_against_the_kubernetes_api(name: str, doc: Doc) -> None:
    # The schema used is the named version's own, not an older one the package falls back to.
    used = kubernetes_validate.validate(doc, kubernetes_version(), strict=True)
    assert used == kubernetes_version().rsplit(".", 1)[0]


def test_the_manifests_include_the_fleet_and_the_sidecar() -> None:
    kinds = {(n.split("#")[0], d["kind"]) for n, d in all_manifests()}
    assert ("sidecar.yaml", "Deployment") in kinds, "the sidecar manifest is kept"
    for kind in ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        assert ("fleet/gateway.yaml", kind) in kinds
    assert ("fleet/valkey.yaml", "StatefulSet") in kinds and ("fleet/llama.yaml", "StatefulSet") in kinds


def misspelled_probe_field(doc: Doc) -> None:
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"


def misspelled_hpa_target(doc: Doc) -> None:
    target = doc["spec"]["metrics"][0]["resource"]["target"]
    target["averageUtilisation"] = target.pop("averageUtilization")


def port_as_a_list(doc: Doc) -> None:
    doc["spec"]["ports"][0]["port"] = [8080]


@pytest.mark.parametrize(
    "kind,name,break_it,field",
    [
        ("Deployment", "tierlane", misspelled_probe_field, "paht"),
        ("HorizontalPodAutoscaler", "tierlane", misspelled_hpa_target, "averageUtilisation"),
        ("Service", "tierlane", port_as_a_list, "8080"),
    ],
)
def test_the_validation_rejects_a_broken_manifest(kind: str, name: str, break_it: Any, field: str) -> None:
    doc = fleet()[(kind, name)]
    kubernetes_validate.validate(doc, kubernetes_version(), strict=True)
    break_it(doc)
    with pytest.raises(kubernetes_validate.ValidationError, match=field):
        kubernetes_validate.validate(doc, kubernetes_version(), strict=True)


# -- 2. the gateway config, loaded as the container loads it ------------------------------------------


def test_the_mounted_config_loads_with_the_gateway_settings_loader(tmp_path: Path) -> None:
    settings, env = gateway_settings(tmp_path)
    deployment, container = gateway()
    assert (settings.auth.mode, settings.server.host) == ("keys", "0.0.0.0")
    assert settings.auth.keys, "the keys file was read"
    (port,) = [p for p in container["ports"] if p["name"] == "http"]
    assert settings.server.port == port["containerPort"]
    # The ledger and cache files are in the pod's state volume.
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(settings.state_dir))
    assert "emptyDir" in next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"])
    # The edge lane's threads fit the CPU request: one core stays with the event loop.
    cpus = resource_quantity(container["resources"]["requests"]["cpu"])
    assert 1 <= settings.edge.n_threads <= cpus - 1


def test_the_state_backend_is_the_valkey_service_with_the_secret_password(tmp_path: Path) -> None:
    settings, _ = gateway_settings(tmp_path)
    assert settings.state.backend == "redis"
    # Read as both of the gateway's Redis clients read it (redis-py's parse_url).
    options = parse_url(settings.state.url)
    assert options["password"] == stand_in("valkey-password"), "the kubelet's $(VALKEY_PASSWORD) expansion"
    service = fleet()[("Service", str(options["host"]))]
    assert options["port"] in [p["port"] for p in service["spec"]["ports"]]
    valkey = fleet()[("StatefulSet", "valkey")]
    assert service["spec"]["clusterIP"] == "None" and valkey["spec"]["serviceName"] == service["metadata"]["name"]
    assert selects(service["spec"]["selector"], pod_labels(valkey))
    (server,) = pod_spec(valkey)["containers"]
    assert {p["containerPort"] for p in server["ports"]} == {options["port"]}
    # Valkey's requirepass is the same Secret key the gateway's URL carries.
    args = server["args"]
    assert args[args.index("--requirepass") + 1] == "$(VALKEY_PASSWORD)"
    _, gateway_container = gateway()
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for c in (server, gateway_container) for e in c["env"]
            if "valueFrom" in e}
    assert container_env(server)["VALKEY_PASSWORD"] == stand_in("valkey-password")
    assert refs["VALKEY_PASSWORD"] == {"name": "tierlane-fleet", "key": "valkey-password"}


def test_valkey_persists_on_a_claim_and_stays_under_its_memory_limit() -> None:
    valkey = fleet()[("StatefulSet", "valkey")]
    (server,) = pod_spec(valkey)["containers"]
    args = server["args"]
    (claim,) = valkey["spec"]["volumeClaimTemplates"]
    data = next(m for m in server["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert args[args.index("--dir") + 1] == data["mountPath"], "the append-only file is written on the claim"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction", "spend is refused, never evicted"
    assert resource_quantity(args[args.index("--maxmemory") + 1].replace("mb", "Mi")) < resource_quantity(
        server["resources"]["limits"]["memory"]
    )


def test_the_pool_members_are_the_llama_servers_with_their_metrics(tmp_path: Path) -> None:
    settings, _ = gateway_settings(tmp_path)
    servers = fleet()[("StatefulSet", "llama")]
    service = fleet()[("Service", servers["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None", "headless: one address per server, no balancing in front"
    assert selects(service["spec"]["selector"], pod_labels(servers))
    (server,) = pod_spec(servers)["containers"]
    args = server["args"]
    port = int(args[args.index("--port") + 1])
    assert "--metrics" in args and port in [p["port"] for p in service["spec"]["ports"]]
    assert port == next(p["containerPort"] for p in server["ports"] if p["name"] == "http")
    alias = args[args.index("-a") + 1]
    members = [u for u in settings.upstreams if u.metrics_url is not None]
    name, governing = servers["metadata"]["name"], service["metadata"]["name"]
    expected = [f"{name}-{i}.{governing}" for i in range(servers["spec"]["replicas"])]
    assert [urlsplit(u.base_url).hostname for u in members] == expected, "one member per server pod"
    for member in members:
        host = f"http://{urlsplit(member.base_url).hostname}:{port}"
        assert (member.base_url, member.metrics_url) == (f"{host}/v1", f"{host}/metrics")
        assert member.models == [alias] and member.api_key is None
    (pool,) = {m.pool for m in members}
    assert settings.pools[pool].balance == "prefix_affinity"
    # `auto` reaches the fleet: the policy's upstream pool is the members' pool; their model is priced.
    policy = load_policy(settings)
    assert policy.section("lanes")["upstream"]["pool"] == pool
    assert alias in Pricing.from_policy(policy).known
    # The init container copies the model the server loads, with a function the image has.
    (init,) = pod_spec(servers)["initContainers"]
    imported = re.search(r"from ([\w.]+) import (\w+)", init["command"][-1])
    copied_to = re.search(r"'(/[^']+)'", init["command"][-1])
    assert imported and copied_to, init["command"]
    assert callable(getattr(importlib.import_module(imported.group(1)), imported.group(2)))
    model = args[args.index("-m") + 1]
    assert model == copied_to.group(1)
    shared = {m["name"] for m in init["volumeMounts"] if model.startswith(m["mountPath"] + "/")}
    assert shared and shared == {m["name"] for m in server["volumeMounts"] if model.startswith(m["mountPath"] + "/")}


def test_the_llama_servers_run_with_the_flags_the_fleet_was_measured_with() -> None:
    from bench.prefix_affinity import SERVER_ARGS

    (server,) = pod_spec(fleet()[("StatefulSet", "llama")])["containers"]
    args = server["args"]

    def flags(argv: list[str]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for i, arg in enumerate(argv):
            if arg.startswith("-") and not arg.lstrip("-").isdigit():
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                out[arg] = None if nxt is None or nxt.startswith("-") else nxt
        return out

    measured, served = flags(SERVER_ARGS), flags(args)
    # the same slots, context, prompt cache and slot reuse as bench/prefix_affinity.py measured
    assert {k: served.get(k) for k in measured} == measured


def test_the_hosted_upstream_key_comes_from_the_secret(tmp_path: Path) -> None:
    settings, env = gateway_settings(tmp_path)
    keyed = [u for u in settings.upstreams if u.api_key_env]
    assert keyed, "an upstream with a key read from the environment"
    for upstream in keyed:
        assert upstream.api_key == stand_in("upstream-api-key") == env[str(upstream.api_key_env)]


def test_the_manifest_variables_are_ones_the_gateway_reads() -> None:
    _, container = gateway()
    read = set(re.findall(r"\"(TIERLANE_[A-Z_]+)\"", (REPO / "gateway" / "settings.py").read_text(encoding="utf-8")))
    named = {e["name"] for e in container["env"] if e["name"].startswith("TIERLANE_")}
    assert named <= read, f"not read by gateway/settings.py: {sorted(named - read)}"


# -- 3. Secrets --------------------------------------------------------------------------------------


def secret_references(doc: Any) -> list[tuple[str, str | None]]:
    """(Secret name, key) of every secretKeyRef, secret volume item and envFrom secretRef (key None) in an object."""
    found: list[tuple[str, str | None]] = []
    if isinstance(doc, dict):
        if "secretKeyRef" in doc:
            found.append((doc["secretKeyRef"]["name"], doc["secretKeyRef"]["key"]))
        if "secret" in doc and isinstance(doc["secret"], dict) and "secretName" in doc["secret"]:
            items = doc["secret"].get("items")
            name = doc["secret"]["secretName"]
            found += [(name, i["key"]) for i in items] if items else [(name, None)]
        if "secretRef" in doc:
            found.append((doc["secretRef"]["name"], None))
        for value in doc.values():
            found += secret_references(value)
    elif isinstance(doc, list):
        for value in doc:
            found += secret_references(value)
    return found


def test_every_secret_reference_names_a_key_of_the_template() -> None:
    secret = template_secret()
    keys = set(secret["stringData"])
    refs = {ref for doc in fleet().values() for ref in secret_references(doc)}
    assert refs, "the fleet reads its keys from a Secret"
    for name, key in refs:
        assert name == secret["metadata"]["name"], f"Secret {name} has no template"
        assert key in keys, f"{name} has no key {key!r} in {SECRET_TEMPLATE.name}"
    assert keys == {k for _, k in refs}, "the template lists only keys the manifests read"


def test_no_manifest_holds_a_secret_value() -> None:
    assert not [k for k in fleet() if k[0] == "Secret"], "the Secret is made with kubectl, not applied from here"
    for doc in fleet().values():
        for spec in (pod_spec(doc),) if doc["kind"] in ("Deployment", "StatefulSet") else ():
            for container in [*spec["containers"], *spec.get("initContainers", [])]:
                for item in container.get("env", []):
                    if re.search(r"PASSWORD|API_KEY$|TOKEN|_AUTH$", item["name"]):
                        assert "valueFrom" in item, f"{item['name']} must come from the Secret"
                    value = str(item.get("value", ""))
                    assert not re.search(r"://[^/@]*:[^$/@][^/@]*@", value), f"{item['name']} holds a password"


def test_the_template_unchanged_stops_the_gateway_instead_of_letting_no_one_in(tmp_path: Path) -> None:
    # Applied as is, its keys.yaml is not a list of keys: the gateway refuses to start.
    keys = tmp_path / "keys.yaml"
    keys.write_text(template_secret()["stringData"]["keys.yaml"], encoding="utf-8")
    with pytest.raises(ValueError, match="must hold a list of keys"):
        read_keys_file(keys)


# -- 4. the objects against each other ---------------------------------------------------------------


def test_the_probes_are_routes_the_gateway_serves_without_a_key(tmp_path: Path) -> None:
    settings, _ = gateway_settings(tmp_path)
    app = create_app(settings)  # the routes only: the components start with the app, never here
    served = {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource is not None}
    containers = [gateway()[1], next(c for d in load_docs(SIDECAR) if d["kind"] == "Deployment"
                                     for c in pod_spec(d)["containers"] if c["name"] == "tierlane")]
    for container in containers:
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                get = container[probe]["httpGet"]
                assert get["path"] in served and get["path"] in UNAUTHENTICATED, get
                assert ports.get(get["port"], get["port"]) == settings.server.port


def test_the_service_pdb_and_autoscaler_target_the_gateway_deployment() -> None:
    deployment, container = gateway()
    labels = pod_labels(deployment)
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    others = [pod_labels(d) for (k, n), d in fleet().items() if k in ("Deployment", "StatefulSet") and n != "tierlane"]
    service = fleet()[("Service", "tierlane")]
    assert selects(service["spec"]["selector"], labels)
    assert not any(selects(service["spec"]["selector"], o) for o in others), "the Service reaches only gateways"
    port_names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    pdb = only("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    hpa = only("HorizontalPodAutoscaler")
    target = {"apiVersion": deployment["apiVersion"], "kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["scaleTargetRef"] == target
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert "cpu" in container["resources"]["requests"], "CPU utilization is measured against the request"
    # The autoscaler owns the count; a drain never takes every replica the PDB allows.
    assert "replicas" not in deployment["spec"]
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_network_policies_admit_the_gateway_pods_to_their_targets() -> None:
    gateway_labels = pod_labels(gateway()[0])
    for (kind, name), policy in fleet().items():
        if kind != "NetworkPolicy":
            continue
        selector = policy["spec"]["podSelector"]["matchLabels"]
        (target,) = [d for (k, _), d in fleet().items() if k == "StatefulSet" and selects(selector, pod_labels(d))]
        ports = {p["containerPort"] for c in pod_spec(target)["containers"] for p in c["ports"]}
        (rule,) = policy["spec"]["ingress"]
        assert any(selects(f["podSelector"]["matchLabels"], gateway_labels) for f in rule["from"]), name
        assert {p["port"] for p in rule["ports"]} == ports, name


def test_the_memory_request_covers_the_measured_peaks() -> None:
    """The figures gateway.yaml's comment cites: re-measured higher, the request must follow."""
    import json

    peers = json.loads((BENCH / "peers.json").read_text(encoding="utf-8"))["peak_rss_mb"]["tierlane_full"]
    engine = json.loads((BENCH / "edge_engine.json").read_text(encoding="utf-8"))["memory"]["engine"]["peak_rss_mb"]
    _, container = gateway()
    request = resource_quantity(container["resources"]["requests"]["memory"])
    assert request >= (peers + engine) * 2**20
    assert resource_quantity(container["resources"]["limits"]["memory"]) > request
    assert "limits" not in container["resources"] or "cpu" not in container["resources"]["limits"]


def test_the_fleet_and_the_sidecar_can_share_a_namespace() -> None:
    sidecar = {(d["kind"], d["metadata"]["name"]) for d in load_docs(SIDECAR)}
    assert not sidecar & set(fleet()), "names the sidecar manifest already uses"
