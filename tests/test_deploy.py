"""The deploy/ artifacts against Kubernetes' schemas and against the daemon they deploy.

The manifest validates against the Kubernetes API's own schemas; every port, path, command and
timeout in it, in the systemd unit and in the Dockerfile agrees with the config it serves and
with the CLI that runs it; the sample configs serve on a real daemon; and every metric the
Grafana dashboard queries is one a real daemon exports.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml  # type: ignore[import-untyped]  # types-PyYAML would be one more test dependency
from prometheus_client.parser import text_string_to_metric_families

from governor.cli import build_parser
from governor.config import Config, parse_address

from .conftest import Daemon

DaemonFactory = Callable[..., Daemon]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "governor.yaml"
BARE_CONFIG = DEPLOY / "governor.toml"
UNIT = DEPLOY / "systemd" / "governor.service"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "governor-dashboard.json"

# The oldest release the manifest is for: native sidecar containers are GA from 1.33.
OLDEST_KUBERNETES = "1.33"
# Time for the daemon to exit after its drain, and the model server after it.
MARGIN_S = 5.0

METRICS_LINE = re.compile(rb"metrics and health probes on http://(\S+):(\d+)")
METRIC_NAME = re.compile(r"governor_[a-z0-9_]+")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


# --- reading the artifacts ----------------------------------------------------------------------


def manifest() -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def resource(kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in manifest() if doc["kind"] == kind]
    return found


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = resource("Deployment")["spec"]["template"]["spec"]
    return spec


def container(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec()["containers"] if c["name"] == name]
    (one,) = found
    return one


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
    configmap = resource("ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
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


def serve_config(daemon: DaemonFactory, config: Path) -> Daemon:
    """A daemon on ``config``, with the stub standing in for the model and port 0 for the
    config's fixed ports."""
    return daemon(
        "--config",
        str(config),
        "--runner",
        "stub",
        "--stub-ms",
        "10",
        "--metrics-listen",
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


def test_manifest_validates_against_the_kubernetes_schemas() -> None:
    docs = manifest()
    assert sorted(doc["kind"] for doc in docs) == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "Service",
    ]
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(part) for part in exc.path)
                pytest.fail(
                    f"{doc['kind']} is invalid on Kubernetes {version}: {where}: {exc.message}"
                )


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


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
    labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    governor = container("governor")
    opened = {port_number(governor, p["port"]) for rule in policy["ingress"] for p in rule["ports"]}
    config = configmap_config()
    assert config.metrics_address is not None
    assert opened == {config.listen_address[1], config.metrics_address[1]}
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
    annotations = resource("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_prestop_drain_fits_in_the_termination_grace_period() -> None:
    config = configmap_config()
    assert config.metrics_address is not None
    command = container("governor")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["governor", "drain"]
    args = parse_cli(command[1:])
    host, port = parse_address(args.metrics_addr)
    assert host in LOOPBACK, "the daemon accepts POST /drain only from loopback peers"
    assert port == config.metrics_address[1]
    # The preStop wait and shutdown_grace (counted from the drain's start) overlap: the longer
    # of the two, plus the exits, must fit before the kubelet's SIGKILL.
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace >= max(args.wait, config.shutdown_grace) + MARGIN_S


def test_service_sends_clients_to_the_listen_port() -> None:
    config = configmap_config()
    host, listen_port = config.listen_address
    assert host not in LOOPBACK
    service = resource("Service")
    template = resource("Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port_number(container("governor"), port["targetPort"]) == listen_port


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


def test_prestop_hook_drains_a_daemon_on_the_configmap_config(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    text, _ = configmap_toml()
    config_file = tmp_path / "governor.toml"
    config_file.write_text(text)
    d = serve_config(daemon, config_file)
    base = f"http://{metrics_address(d)}"
    governor = container("governor")
    status, body = http_get(base + governor["livenessProbe"]["httpGet"]["path"])
    assert status == 200
    json.loads(body)
    status, body = http_get(base + governor["readinessProbe"]["httpGet"]["path"])
    assert status in (200, 503)  # 503 until the first probe has passed
    json.loads(body)
    status, _ = http_get(base + "/metrics")
    assert status == 200

    command = list(governor["lifecycle"]["preStop"]["exec"]["command"])
    command[command.index("--metrics-addr") + 1] = metrics_address(d)
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


# --- the image ----------------------------------------------------------------------------------


def test_dockerfile_serves_the_mounted_config_as_the_pods_user() -> None:
    instructions = dockerfile_instructions()

    def last(word: str) -> str:
        return [rest for w, rest in instructions if w == word][-1]

    entrypoint: list[str] = json.loads(last("ENTRYPOINT"))
    cmd: list[str] = json.loads(last("CMD"))
    assert entrypoint == ["/opt/governor/.venv/bin/governor"]
    args = parse_cli(cmd)
    assert args.command == "serve"
    _, mounted = configmap_toml()
    assert args.config == mounted
    governor = container("governor")
    assert "command" not in governor, "the image's ENTRYPOINT runs the governor"
    # The preStop hook runs `governor` from PATH.
    env = " ".join(rest for w, rest in instructions if w == "ENV")
    assert re.search(r"PATH=/opt/governor/\.venv/bin:", env)
    config = configmap_config()
    exposed = {int(port) for port in last("EXPOSE").split()}
    assert config.metrics_address is not None
    assert exposed == {config.listen_address[1], config.metrics_address[1]}
    user = last("USER")
    assert user.isdigit(), "a numeric UID lets runAsNonRoot check it"
    assert int(user) != 0
    assert int(user) == pod_spec()["securityContext"]["runAsUser"]


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
