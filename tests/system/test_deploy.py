"""The deploy/ artifacts against Kubernetes' schemas and against the daemon they deploy.

The manifest validates against the Kubernetes API's own schemas; every port, path, command and
timeout in it, in the systemd unit and in the Dockerfile agrees with the config it serves and
with the CLI that runs it; its fleet (replicas, their Redis, the disruption budget) hangs
together; the sample configs serve on a real daemon; and every metric the Grafana dashboard
queries is one a real daemon exports.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import redis as redis_client
import yaml  # type: ignore[import-untyped]  # types-PyYAML would be one more test dependency
from prometheus_client.parser import text_string_to_metric_families

from governor.cli import build_parser, config_from_args
from governor.config import Config, parse_address
from governor.listeners.admin import READY_TIMEOUT_S
from loadtest.support.processes import free_port
from loadtest.support.redisserver import RedisServer
from tests.conftest import Daemon

DaemonFactory = Callable[..., Daemon]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "governor.yaml"
AUTOSCALING = DEPLOY / "kubernetes" / "autoscaling.yaml"
BARE_CONFIG = DEPLOY / "governor.toml"
UNIT = DEPLOY / "systemd" / "governor.service"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "governor-dashboard.json"

# The oldest release the manifest is for: native sidecar containers are GA from 1.33.
OLDEST_KUBERNETES = "1.33"
# Time for the daemon to exit after its drain, and the model server after it.
MARGIN_S = 5.0

# The manifest's two workloads, by their Deployments' names.
GOVERNOR = "governor"
REDIS = "governor-redis"
# A name the kubelet would give a governor pod, for $(POD_NAME).
POD_NAME = "governor-5c9d7f8b6d-x2k4q"
# Kubernetes' dependent environment variables in a container's command and args.
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

METRICS_LINE = re.compile(rb"metrics and health probes on http://(\S+):(\d+)")
METRIC_NAME = re.compile(r"governor_[a-z0-9_]+")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


# --- reading the artifacts ----------------------------------------------------------------------


def manifest() -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def resource(kind: str, name: str = GOVERNOR) -> dict[str, Any]:
    found = [d for d in manifest() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name!r}"
    return found[0]


def pod_template(deployment: str = GOVERNOR) -> dict[str, Any]:
    template: dict[str, Any] = resource("Deployment", deployment)["spec"]["template"]
    return template


def pod_spec(deployment: str = GOVERNOR) -> dict[str, Any]:
    spec: dict[str, Any] = pod_template(deployment)["spec"]
    return spec


def pod_labels(deployment: str = GOVERNOR) -> dict[str, str]:
    labels: dict[str, str] = pod_template(deployment)["metadata"]["labels"]
    return labels


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers (the sidecar among them) and containers."""
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(name: str, deployment: str = GOVERNOR) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in pod_spec(deployment)["containers"] if c["name"] == name
    ]
    (one,) = found
    return one


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (a Service's plain map, or matchLabels) picks pods with
    ``labels``. matchExpressions are not used here, so not implemented."""
    assert "matchExpressions" not in selector, "extend selects() for matchExpressions"
    match: dict[str, str] = selector.get("matchLabels", selector)
    assert match, "an empty selector selects every pod"
    return match.items() <= labels.items()


def expand_env_refs(args: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does to a container's args: $(VAR) from its env; unknown ones stay."""
    return [ENV_REF.sub(lambda m: env.get(m[1], m[0]), arg) for arg in args]


def container_env(of: dict[str, Any], pod_name: str) -> dict[str, str]:
    """A container's env as the kubelet fills it in: the pod's name for its metadata.name, a
    placeholder for a Secret's or ConfigMap's key."""
    fields = {"metadata.name": pod_name}
    env = {}
    for var in of.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            ((kind, ref),) = source.items()
            env[var["name"]] = f"<{kind} {ref['name']}/{ref['key']}>"
    return env


def redis_port() -> int:
    """The port Redis listens on: its --port, which its container declares."""
    redis = container("redis", REDIS)
    args = redis["args"]
    port = int(args[args.index("--port") + 1])
    assert port_number(redis, "redis") == port
    return port


def port_number(of: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container's name for it."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in of["ports"] if p["name"] == port]
    assert isinstance(number, int)
    return number


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``governor ARGV`` as the real CLI parses it, failing the test instead of exiting."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the governor CLI rejects {shlex.join(argv)!r}")


def configmap_toml() -> tuple[str, Path]:
    """The governor.toml the governor container serves, and the path it is mounted at."""
    governor = container("governor")
    config_path = parse_cli(governor["args"]).config
    assert config_path is not None, "the governor container serves no --config file"
    (mount,) = [m for m in governor["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == mount["name"]]
    configmap = resource("ConfigMap", volume["configMap"]["name"])
    text: str = configmap["data"][config_path.name]
    return text, config_path


def configmap_config() -> Config:
    text, path = configmap_toml()
    return Config.from_mapping(tomllib.loads(text), source=f"ConfigMap {path}")


def unit() -> dict[str, dict[str, list[str]]]:
    """The systemd unit as section -> key -> values (a key may be given more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(timespan: str) -> float:
    """A systemd time span with one unit (``40``, ``40s``, ``2min``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", timespan)
    assert match, f"unsupported time span {timespan!r}"
    return float(match[1]) * (60 if match[2] in ("min", "m") else 1)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    lines = DOCKERFILE.read_text().replace("\\\n", " ").splitlines()
    instructions = [
        (word.upper(), rest.strip())
        for word, _, rest in (line.strip().partition(" ") for line in lines)
        if word and not word.startswith("#")
    ]
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows and panels, including the panels inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_panels() -> list[dict[str, Any]]:
    """The panels that draw something."""
    return [p for p in all_panels(dashboard()["panels"]) if p["type"] != "row"]


def family_and_suffix(name: str) -> tuple[str, str]:
    """``governor_x_bucket`` -> (``governor_x``, ``_bucket``): the family a series belongs to."""
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return name, ""


def serve_config(daemon: DaemonFactory, config: Path, *flags: str) -> Daemon:
    """A daemon on ``config`` (and ``flags``), with the stub standing in for the model and port
    0 for the config's fixed ports."""
    return daemon(
        "--config",
        str(config),
        *flags,
        "--runner",
        "stub",
        "--stub-ms",
        "10",
        "--metrics-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    )


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def metrics_address(d: Daemon) -> str:
    match = METRICS_LINE.search(d.stderr_head)
    assert match, f"no metrics listener in {d.stderr_head.decode(errors='replace')}"
    return f"{match[1].decode()}:{int(match[2])}"


# --- Kubernetes ---------------------------------------------------------------------------------


def validate(docs: list[dict[str, Any]]) -> None:
    """Each of ``docs`` is valid on the oldest Kubernetes the manifest is for and the latest."""
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(part) for part in exc.path)
                pytest.fail(
                    f"{doc['kind']} {doc['metadata']['name']} is invalid on Kubernetes "
                    f"{version}: {where}: {exc.message}"
                )


def test_manifest_validates_against_the_kubernetes_schemas() -> None:
    docs = manifest()
    assert sorted((doc["kind"], doc["metadata"]["name"]) for doc in docs) == [
        ("ConfigMap", "governor-config"),
        ("Deployment", GOVERNOR),
        ("Deployment", REDIS),
        ("NetworkPolicy", GOVERNOR),
        ("NetworkPolicy", REDIS),
        ("PodDisruptionBudget", GOVERNOR),
        ("Service", GOVERNOR),
        ("Service", REDIS),
    ]
    validate(docs)


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_every_container_is_sized_and_locked_down() -> None:
    """Requests and limits for CPU and memory, requests within limits; no privilege
    escalation, no capabilities, a read-only root; pods as a non-root UID under the runtime's
    seccomp profile. For every container of every workload, the model server's included."""
    deployments = [d["metadata"]["name"] for d in manifest() if d["kind"] == "Deployment"]
    assert sorted(deployments) == [GOVERNOR, REDIS]
    for deployment in deployments:
        spec = pod_spec(deployment)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, deployment
        assert pod["runAsUser"] != 0, deployment
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", deployment
        for c in all_containers(spec):
            name = f"{deployment}/{c['name']}"
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert cores(requests["cpu"]) <= cores(limits["cpu"]), name
            assert mebibytes(requests["memory"]) <= mebibytes(limits["memory"]), name
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in security["capabilities"], name
            assert security.get("runAsUser", pod["runAsUser"]) != 0, name


def test_what_clients_may_make_the_governor_hold_fits_its_memory_limit() -> None:
    """Payload buffers, a full line on every connection, and a few slow readers' unread
    replies, beside the interpreter: under the container's limit, by a margin."""
    config = configmap_config()
    limit = mebibytes(container("governor")["resources"]["limits"]["memory"])
    held = (
        config.max_buffer_bytes
        + config.max_connections * config.max_line_bytes
        + 16 * config.write_buffer_bytes
    ) / 2**20
    assert held + 100 < limit, f"{held:.0f} MiB held + the interpreter within {limit:.0f} MiB"
    assert 0 < config.max_connections_per_source < config.max_connections


def test_the_network_policy_opens_the_governors_ports_only() -> None:
    policy = resource("NetworkPolicy")["spec"]
    assert selects(policy["podSelector"], pod_labels())
    # Ingress only: the governors' own way out, to Redis, is not closed by it.
    assert policy["policyTypes"] == ["Ingress"]
    governor = container("governor")
    opened = {port_number(governor, p["port"]) for rule in policy["ingress"] for p in rule["ports"]}
    config = configmap_config()
    assert config.metrics_address is not None
    assert config.http_address is not None
    listeners = (config.listen_address, config.metrics_address, config.http_address)
    assert opened == {address[1] for address in listeners}
    assert all(rule["from"] for rule in policy["ingress"])  # no rule open to everyone


def test_configmap_config_is_the_one_served_and_loads() -> None:
    text, path = configmap_toml()
    assert path == Path("/etc/governor/governor.toml")
    config = configmap_config()
    assert config.runner == "http"
    assert config.shutdown_grace > 0
    assert set(tomllib.loads(text)) >= {"listen", "metrics_listen", "upstream", "shutdown_grace"}


def test_probes_and_scrape_annotations_match_the_metrics_listener() -> None:
    config = configmap_config()
    assert config.metrics_address is not None
    host, metrics_port = config.metrics_address
    assert host not in LOOPBACK, "the kubelet probes and Prometheus scrapes the pod IP"
    governor = container("governor")
    want = {
        "livenessProbe": ("/healthz/live",),
        "readinessProbe": ("/healthz/ready",),
        "startupProbe": ("/healthz/live", "/healthz/ready"),
    }
    for probe, paths in want.items():
        get = governor[probe]["httpGet"]
        assert get["path"] in paths, probe
        assert port_number(governor, get["port"]) == metrics_port, probe
    assert 2 <= governor["readinessProbe"]["periodSeconds"] <= 5
    annotations = pod_template()["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_prestop_drain_fits_in_the_termination_grace_period() -> None:
    config = configmap_config()
    assert config.metrics_address is not None
    command = container("governor")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["governor", "drain"]
    args = parse_cli(command[1:])
    host, port = parse_address(args.metrics_listen)
    assert host in LOOPBACK, "the daemon accepts POST /drain only from loopback peers"
    assert port == config.metrics_address[1]
    # The preStop wait and shutdown_grace (counted from the drain's start) overlap: the longer
    # of the two, plus the exits, must fit before the kubelet's SIGKILL.
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace >= max(args.wait, config.shutdown_grace) + MARGIN_S


def test_service_sends_clients_to_the_protocol_and_openai_ports() -> None:
    config = configmap_config()
    assert config.http_address is not None
    for host, _ in (config.listen_address, config.http_address):
        assert host not in LOOPBACK
    service = resource("Service")
    assert selects(service["spec"]["selector"], pod_labels())
    targets = {
        p["name"]: port_number(container("governor"), p["targetPort"])
        for p in service["spec"]["ports"]
    }
    assert targets == {"protocol": config.listen_address[1], "openai": config.http_address[1]}


def test_model_server_is_a_loopback_sidecar_sized_for_the_cap() -> None:
    config = configmap_config()
    (sidecar,) = pod_spec()["initContainers"]
    # An init container that keeps running: started before the governor, stopped after it.
    assert sidecar["restartPolicy"] == "Always"
    assert "startupProbe" in sidecar
    args = sidecar["args"]

    def arg(flag: str) -> str:
        value: str = args[args.index(flag) + 1]
        return value

    assert arg("--host") in LOOPBACK, "only the governor may reach the model"
    assert config.upstream == f"http://127.0.0.1:{arg('--port')}"
    assert config.max_inflight <= int(arg("-np")), "admitted jobs would queue in llama-server"
    assert config.kv_capacity <= int(arg("-c"))


@pytest.mark.parametrize("store", ["up", "down"])
def test_prestop_hook_drains_a_daemon_on_the_configmap_config(
    daemon: DaemonFactory, tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    """The governor container's own args on the ConfigMap's config, with a pod's name for
    $(POD_NAME); its redis_url pointed at a local Redis, or at a closed port (a pod that starts
    before its Redis, or loses it, must still serve its probes and drain)."""
    text, _ = configmap_toml()
    url = tomllib.loads(text)["redis_url"]
    redis: RedisServer | None = request.getfixturevalue("redis_server") if store == "up" else None
    local = redis.url if redis is not None else f"redis://127.0.0.1:{free_port()}/0"
    text = text.replace(f'"{url}"', f'"{local}"')
    assert tomllib.loads(text)["redis_url"] == local
    config_file = tmp_path / "governor.toml"
    config_file.write_text(text)
    governor = container("governor")
    args = expand_env_refs(governor["args"], container_env(governor, POD_NAME))
    assert args[0] == "serve"  # start_daemon adds it
    args[args.index("--config") + 1] = str(config_file)
    d = serve_config(daemon, config_file, *args[1:])
    # The daemon names each run POD_NAME/SUFFIX, so that a restarted container's leases are
    # never taken for its predecessor's.
    d.wait_for_log(rb"fleet: replica " + re.escape(POD_NAME.encode()) + rb"/", timeout=10)
    if redis is not None:  # its heartbeat, under the pod's name
        with redis_client.Redis.from_url(redis.url) as client:
            deadline = time.monotonic() + configmap_config().lease_ttl
            while not any(
                member.decode().partition("/")[0] == POD_NAME
                for key in client.scan_iter(match="*replicas*", _type="zset")
                for member in client.zrange(key, 0, -1)
            ):
                assert time.monotonic() < deadline, "no heartbeat in Redis under the pod's name"
                time.sleep(0.1)
    base = f"http://{metrics_address(d)}"
    status, body = http_get(base + governor["livenessProbe"]["httpGet"]["path"])
    assert status == 200
    json.loads(body)
    # Ready once a probe has passed, Redis or no Redis: a pod without its store fails open,
    # and a Redis outage must not empty the Service.
    config = configmap_config()
    deadline = time.monotonic() + config.probe_interval + config.probe_timeout
    while True:
        status, body = http_get(base + governor["readinessProbe"]["httpGet"]["path"])
        json.loads(body)
        if status == 200:
            break
        assert status == 503
        assert time.monotonic() < deadline, f"not ready with the store {store}: {body!r}"
        time.sleep(0.1)
    status, _ = http_get(base + "/metrics")
    assert status == 200

    command = list(governor["lifecycle"]["preStop"]["exec"]["command"])
    command[command.index("--metrics-listen") + 1] = metrics_address(d)
    hook = subprocess.run(
        [sys.executable, "-m", "governor", *command[1:]],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert hook.returncode == 0, hook.stderr.decode(errors="replace")
    status, _ = http_get(base + governor["readinessProbe"]["httpGet"]["path"])
    assert status == 503, "a drained pod must leave the Service's endpoints"
    d.signal(signal.SIGTERM)  # what the kubelet sends when the hook returns
    returncode, _ = d.wait(timeout=pod_spec()["terminationGracePeriodSeconds"])
    assert returncode == 0


# --- the fleet ----------------------------------------------------------------------------------


def test_each_selector_picks_its_own_workloads_pods_only() -> None:
    """The governor's Service, NetworkPolicy and PodDisruptionBudget select the governor pods
    and not Redis; Redis's Service and NetworkPolicy select Redis and not the governors."""
    workloads = {GOVERNOR: pod_labels(GOVERNOR), REDIS: pod_labels(REDIS)}
    assert selects(resource("Deployment", GOVERNOR)["spec"]["selector"], workloads[GOVERNOR])
    assert selects(resource("Deployment", REDIS)["spec"]["selector"], workloads[REDIS])
    selectors = {
        ("Service", GOVERNOR): resource("Service", GOVERNOR)["spec"]["selector"],
        ("NetworkPolicy", GOVERNOR): resource("NetworkPolicy", GOVERNOR)["spec"]["podSelector"],
        ("PodDisruptionBudget", GOVERNOR): resource("PodDisruptionBudget")["spec"]["selector"],
        ("Service", REDIS): resource("Service", REDIS)["spec"]["selector"],
        ("NetworkPolicy", REDIS): resource("NetworkPolicy", REDIS)["spec"]["podSelector"],
    }
    for (kind, owner), selector in selectors.items():
        picked = {name for name, labels in workloads.items() if selects(selector, labels)}
        assert picked == {owner}, f"{kind} {owner} selects the pods of {sorted(picked)}"


def allowed_disruptions(budget: dict[str, Any], replicas: int) -> int:
    """Pods of ``replicas`` ready ones a PodDisruptionBudget lets be evicted at once
    (percentages round up, as the disruption controller rounds them)."""

    def count(value: int | str) -> int:
        if isinstance(value, str):
            return math.ceil(replicas * int(value.removesuffix("%")) / 100)
        return value

    if "maxUnavailable" in budget:
        return count(budget["maxUnavailable"])
    return replicas - count(budget["minAvailable"])


def test_disruption_budget_lets_governors_go_one_at_a_time() -> None:
    """Node drains proceed (at least one pod may go), and never take every governor at once."""
    replicas = resource("Deployment")["spec"]["replicas"]
    assert replicas > 1
    budget = resource("PodDisruptionBudget")["spec"]
    assert selects(budget["selector"], pod_labels())
    assert 1 <= allowed_disruptions(budget, replicas) < replicas
    # A rollout takes none out of service before its replacement is ready.
    rollout = resource("Deployment")["spec"]["strategy"]
    assert rollout["type"] == "RollingUpdate"
    assert rollout["rollingUpdate"]["maxUnavailable"] == 0
    assert rollout["rollingUpdate"]["maxSurge"] in (1, "1")


def test_governors_spread_over_nodes_without_insisting() -> None:
    constraints = pod_spec()["topologySpreadConstraints"]
    keys = {c["topologyKey"] for c in constraints}
    assert "kubernetes.io/hostname" in keys
    for c in constraints:
        where = c["topologyKey"]
        # Soft: a cluster of fewer nodes than replicas still runs them all.
        assert c["whenUnsatisfiable"] == "ScheduleAnyway", where
        assert c["maxSkew"] == 1, where
        assert selects(c["labelSelector"], pod_labels()), where
        assert not selects(c["labelSelector"], pod_labels(REDIS)), where


def test_redis_url_names_the_redis_service() -> None:
    """redis_url: the Redis Service's in-cluster DNS name and port, which reach Redis's own."""
    config = configmap_config()
    assert config.redis_url is not None
    url = urllib.parse.urlsplit(config.redis_url)
    assert url.scheme == "redis"
    assert url.hostname is not None
    # governor-redis, governor-redis.NAMESPACE, ...NAMESPACE.svc, ...svc.cluster.local
    name, *domain = url.hostname.split(".")
    assert name == REDIS
    assert domain[1:2] in ([], ["svc"]), f"{url.hostname} is not a Service's DNS name"
    service = resource("Service", REDIS)["spec"]
    (port,) = service["ports"]
    assert (url.port or 6379) == port["port"]
    assert port_number(container("redis", REDIS), port["targetPort"]) == redis_port()
    assert url.path in ("", "/") or url.path.lstrip("/").isdigit()


def test_fleet_cap_is_every_replicas_slots() -> None:
    """fleet_max_inflight = replicas x max_inflight: each pod has its own model server, with
    as many slots as its max_inflight (the sidecar test checks -np)."""
    config = configmap_config()
    replicas = resource("Deployment")["spec"]["replicas"]
    assert config.fleet_max_inflight == replicas * config.max_inflight
    assert config.fleet_fail_lanes, "some work must go on while Redis is away"


def test_redis_admits_only_the_governor_pods() -> None:
    policy = resource("NetworkPolicy", REDIS)["spec"]
    assert selects(policy["podSelector"], pod_labels(REDIS))
    assert "Ingress" in policy["policyTypes"]
    assert policy["ingress"], "no ingress rules: nothing may connect, not even the governors"
    for rule in policy["ingress"]:
        assert rule.get("from"), "a rule without `from` admits every source"
        for peer in rule["from"]:
            # A podSelector alone: pods of this namespace, no other namespace or address block.
            assert peer.keys() == {"podSelector"}, peer
            assert selects(peer["podSelector"], pod_labels(GOVERNOR)), peer
            assert not selects(peer["podSelector"], pod_labels(REDIS)), peer
        ports = rule.get("ports")
        assert ports, "a rule without ports opens every port"
        assert {port_number(container("redis", REDIS), p["port"]) for p in ports} == {redis_port()}


def test_replica_id_is_the_pod_name() -> None:
    governor = container("governor")
    env = container_env(governor, POD_NAME)
    assert all(m[1] in env for arg in governor["args"] for m in ENV_REF.finditer(arg)), (
        "the kubelet leaves an undefined $(VAR) as it is"
    )
    args = parse_cli(expand_env_refs(governor["args"], env))
    assert args.replica_id == POD_NAME
    (var,) = [v for v in governor["env"] if v["name"] == "POD_NAME"]
    assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # One ConfigMap for every pod: a replica_id in it would give them all the same.
    text, _ = configmap_toml()
    assert "replica_id" not in tomllib.loads(text)


def test_redis_is_one_instance_with_nothing_on_disk() -> None:
    """One Redis, never two at once (governors on two stores would each count a part of the
    fleet); no persistence (leases and buckets expire anyway); in its memory limit; probed."""
    deployment = resource("Deployment", REDIS)["spec"]
    assert deployment["replicas"] == 1
    assert deployment["strategy"]["type"] == "Recreate"
    redis = container("redis", REDIS)
    assert redis["image"].split("@")[0] == "redis:7"
    args = redis["args"]
    assert args[0] == "redis-server"

    def arg(flag: str) -> str:
        value: str = args[args.index(flag) + 1]
        return value

    assert arg("--save") == ""
    assert arg("--appendonly") == "no"
    maxmemory = arg("--maxmemory")
    assert maxmemory.endswith("mb")
    assert float(maxmemory[:-2]) < mebibytes(redis["resources"]["limits"]["memory"])
    assert all("persistentVolumeClaim" not in v for v in pod_spec(REDIS).get("volumes", []))
    for probe in ("readinessProbe", "livenessProbe"):
        command = " ".join(redis[probe]["exec"]["command"])
        assert "redis-cli" in command, probe
        assert "ping" in command, probe
        assert str(redis_port()) in command, probe


def test_a_drain_takes_the_pod_out_of_the_service_promptly() -> None:
    """The kubelet sees a draining pod's failed readiness long before the drain's wait ends,
    and one slow answer does not take a healthy pod out."""
    config = configmap_config()
    governor = container("governor")
    ready = governor["readinessProbe"]
    seen_within = ready["periodSeconds"] * ready["failureThreshold"] + ready["timeoutSeconds"]
    drain = parse_cli(governor["lifecycle"]["preStop"]["exec"]["command"][1:])
    assert seen_within <= 10
    assert seen_within < min(drain.wait, config.shutdown_grace) / 2
    assert ready["failureThreshold"] >= 2
    assert ready["successThreshold"] == 1
    # The daemon answers within READY_TIMEOUT_S (a 503 naming a stalled loop): the kubelet
    # waits longer, so it gets that answer instead of a timeout.
    assert ready["timeoutSeconds"] > READY_TIMEOUT_S
    # Its probes through the model server come often enough that a healthy pod's last success
    # is never older than readiness allows.
    assert config.probe_interval + config.probe_timeout < config.probe_max_age


# --- the image ----------------------------------------------------------------------------------


def test_dockerfile_serves_every_interface_and_the_pod_its_mounted_config() -> None:
    instructions = dockerfile_instructions()

    def last(word: str) -> str:
        return [rest for w, rest in instructions if w == word][-1]

    entrypoint: list[str] = json.loads(last("ENTRYPOINT"))
    cmd: list[str] = json.loads(last("CMD"))
    assert entrypoint == ["/opt/governor/.venv/bin/governor"]
    env = dict(
        pair.split("=", 1) for w, rest in instructions if w == "ENV" for pair in shlex.split(rest)
    )
    # The preStop hook runs `governor` from PATH.
    assert env["PATH"].startswith("/opt/governor/.venv/bin:")
    # `docker run IMAGE` serves the embedded model on every interface, its ports exposed.
    args = parse_cli(cmd)
    assert args.command == "serve"
    assert args.config is None
    served = config_from_args(args, env)
    addresses = [served.listen_address, served.http_address, served.metrics_address]
    assert all(a is not None and a[0] == "0.0.0.0" for a in addresses), addresses
    exposed = {int(port) for port in last("EXPOSE").split()}
    assert exposed == {a[1] for a in addresses if a is not None}
    # The pod serves its mounted config, on ports the image exposes.
    governor = container("governor")
    assert "command" not in governor, "the image's ENTRYPOINT runs the governor"
    _, mounted = configmap_toml()
    assert parse_cli(governor["args"]).config == mounted
    config = configmap_config()
    assert config.metrics_address is not None
    assert config.http_address is not None
    assert {config.listen_address[1], config.http_address[1], config.metrics_address[1]} <= exposed
    user = last("USER")
    assert user.isdigit(), "a numeric UID lets runAsNonRoot check it"
    assert int(user) != 0
    assert int(user) == pod_spec()["securityContext"]["runAsUser"]


def test_image_has_the_redis_client_the_configmap_needs() -> None:
    """The image installs the package's own dependencies (not the test extras): the fleet's
    Redis client must be one of them."""
    assert configmap_config().redis_url is not None
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        assert name, requirement
        names.add(name[0].lower())
    assert "redis" in names
    copied = [rest.split() for word, rest in dockerfile_instructions() if word == "COPY"]
    assert any("/opt/governor" in parts for parts in copied)


# --- systemd ------------------------------------------------------------------------------------


def test_bare_host_config_loads() -> None:
    config = Config.load(BARE_CONFIG)
    assert config.runner == "llama"
    assert config.listen_address[0] in LOOPBACK
    assert config.metrics_address is not None
    assert config.metrics_address[0] in LOOPBACK, "POST /drain must stay on the host"


def test_systemd_unit_matches_the_bare_host_config() -> None:
    service = unit()["Service"]
    config = Config.load(BARE_CONFIG)
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/governor/.venv/bin/governor"
    args = parse_cli(argv[1:])
    assert args.command == "serve"
    assert args.config == Path("/etc/governor/governor.toml")
    assert service["KillSignal"] == ["SIGTERM"]
    # control-group would SIGTERM the llama workers too, under the jobs the drain waits for.
    assert service["KillMode"] == ["mixed"]
    assert seconds(service["TimeoutStopSec"][-1]) >= config.shutdown_grace + MARGIN_S
    assert service["Restart"] == ["on-failure"]
    assert int(service["LimitNOFILE"][-1]) >= config.max_connections + 64


def test_bare_host_config_serves(daemon: DaemonFactory) -> None:
    d = serve_config(daemon, BARE_CONFIG)
    status, _ = http_get(f"http://{metrics_address(d)}/healthz/live")
    assert status == 200


# --- Grafana ------------------------------------------------------------------------------------


def test_dashboard_panels_each_query_the_prometheus_datasource() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in all_panels(board["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    panels = dashboard_panels()
    assert panels
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert METRIC_NAME.search(target["expr"]), title


def test_dashboard_queries_only_metrics_the_daemon_exports(daemon: DaemonFactory) -> None:
    d = daemon("--lanes", "true", "--metrics-listen", "127.0.0.1:0", "--stub-ms", "10")
    status, body = http_get(f"http://{metrics_address(d)}/metrics")
    assert status == 200
    # The parser names a counter's family without its _total.
    exported = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    used = {
        name
        for panel in dashboard_panels()
        for target in panel["targets"]
        for name in METRIC_NAME.findall(target["expr"])
    }
    unknown = []
    for name in sorted(used):
        family, suffix = family_and_suffix(name)
        kind = exported.get(family)
        if suffix in ("_bucket", "_sum", "_count"):
            ok = kind == "histogram"
        elif suffix == "_total":
            ok = kind == "counter"
        else:  # a counter or histogram has no series under its bare name
            ok = kind == "gauge"
        if not ok:
            unknown.append(f"{name} (exported as {kind or 'nothing'})")
    assert not unknown, f"the dashboard queries what the daemon does not export: {unknown}"


def test_the_autoscaler_scales_the_governors_on_what_the_adapter_makes_of_their_metrics(
    daemon: DaemonFactory,
) -> None:
    """autoscaling.yaml: valid; its HorizontalPodAutoscaler scales the governor Deployment from
    its replicas up, on the metric prometheus-adapter's rule names, and that rule reads a
    counter every daemon exports."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(AUTOSCALING.read_text()) if d}
    assert sorted(docs) == ["ConfigMap", "HorizontalPodAutoscaler"]
    validate(list(docs.values()))
    spec = docs["HorizontalPodAutoscaler"]["spec"]
    deployment = resource("Deployment")
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        GOVERNOR,
    )
    assert spec["minReplicas"] == deployment["spec"]["replicas"] < spec["maxReplicas"]
    (metric,) = spec["metrics"]
    (rule,) = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    (series,) = METRIC_NAME.findall(rule["seriesQuery"])
    d = daemon("--metrics-listen", "127.0.0.1:0", "--stub-ms", "10")
    status, body = http_get(f"http://{metrics_address(d)}/metrics")
    assert status == 200
    exported = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert series.endswith("_total")
    assert exported.get(series.removesuffix("_total")) == "counter"
