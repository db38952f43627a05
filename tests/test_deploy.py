"""The deploy files as data: compose, the Dockerfile and `/.dockerignore`, the Kubernetes manifests,
the systemd unit and `.env.example` parsed and checked (no container engine needed); the health
check they all run, against a real `threadline worker` supervisor; and the gateway's probe paths,
against its app."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.support.wait import poll
from threadline.pipeline.policy import CONVENTIONAL_KEY_NAMES, REGION_VARIABLES
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.operations import metrics_server
from threadline.workers.operations.status import Operations
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import queues as all_queues
from threadline.workers.settings import Settings
from threadline.workers.telemetry import metrics
from threadline.workers.worker.process import KILL_MARGIN_S, STACKS_S

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
HEALTHCHECK = DEPLOY / "healthcheck.py"
SECRET_NAME = re.compile(r"_KEY$|SECRET|PASSWORD|TOKEN|_AUTH$|^REDIS_URL$")
#: Variables of the deploy files themselves, not of Threadline: compose's and Redis's.
DEPLOY_ONLY = {"REDIS_PASSWORD", "REDISCLI_AUTH"}
#: A worker container's stop takes the children's grace (TL_SHUTDOWN_GRACE_S, default 5 s) and the
#: supervisor's kill margin and the moment it gives a stuck child to write its stacks, then the
#: interpreter's exit: every stop timeout gives it twice that.
MIN_GRACE_S = 2 * (Settings.from_env({}).shutdown_grace_s + KILL_MARGIN_S + STACKS_S)
#: The gateway's port in every file (`threadline gateway --port`).
GATEWAY_PORT = 8080

Doc = dict[str, Any]


# --- loading ----------------------------------------------------------------------------------------


#: The settings table (a markdown table whose first column is `` `VAR` ``) lives in this page.
SETTINGS_DOC = ROOT / "docs" / "operations.md"


def documented_settings() -> set[str]:
    """The variables of the settings table under `## Settings (environment)` of docs/operations.md."""
    doc = SETTINGS_DOC.read_text()
    assert "## Settings (environment)" in doc, f"{SETTINGS_DOC} has no settings table"
    table = doc.split("## Settings (environment)", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    return names


def read_settings() -> set[str]:
    """The variables `workers/settings.py` reads."""
    return set(re.findall(r'"((?:TL_[A-Z0-9_]+)|REDIS_URL)"', (ROOT / "workers" / "settings.py").read_text()))


def known_variables() -> set[str]:
    """Every variable Threadline reads: `workers/settings.py`, the settings table of docs/operations.md,
    and the providers' key and region variables."""
    return read_settings() | documented_settings() | CONVENTIONAL_KEY_NAMES | REGION_VARIABLES


KNOWN = known_variables()


def test_the_settings_table_names_every_variable_the_settings_read() -> None:
    documented = documented_settings()
    assert len(documented) > 20, f"the settings table of {SETTINGS_DOC} was not found whole"
    assert sorted(read_settings() - documented) == [], f"missing from the settings table of {SETTINGS_DOC}"


def compose() -> Doc:
    doc: Doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def manifests() -> list[Doc]:
    """Every Kubernetes object under deploy/k8s (kustomizations excluded)."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [{**doc, "_file": path} for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def of_kind(kind: str) -> list[Doc]:
    return [doc for doc in manifests() if doc["kind"] == kind]


def named(kind: str, name: str) -> Doc:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def instructions(name: str) -> list[str]:
    return [args for instruction, args in dockerfile() if instruction == name]


def dockerfile_env() -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(instructions("ENV"))))


def installed_healthcheck() -> str:
    """Where the Dockerfile installs deploy/healthcheck.py."""
    (copy,) = [args for args in instructions("COPY") if "deploy/healthcheck.py" in args]
    return copy.split()[-1]


def seconds(duration: str | int) -> float:
    """A compose duration (`30s`, `1m30s`) or a number of seconds."""
    if isinstance(duration, int):
        return duration
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"not a duration: {duration!r}"
    return int(parts[1] or 0) * 60 + int(parts[2] or 0)


def queue_flags(args: list[str]) -> list[str]:
    return args[args.index("--queues") + 1:] if "--queues" in args else []


def assert_pinned(image: str, *, ours: bool = False) -> None:
    """A version tag (`7.4.2-alpine`); ours the project's version. (No digest: none could be checked
    against a registry from here, and a wrong one fails every pull; deploy/README.md says how to add one.)"""
    assert ":latest" not in image, image
    name, _, tag = image.split("@")[0].rpartition(":")
    assert name and re.match(r"\d+\.\d+\.\d+", tag), f"{image} has no version tag"
    if ours:
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert tag == version, f"{image}: the worker image's tag is the project's version, {version}"


def assert_no_plaintext_secret(name: str, value: object) -> None:
    """A secret-looking variable gets its value from elsewhere (`${VAR}`, `$(VAR)`), never inline."""
    text = str(value)
    if SECRET_NAME.search(name) and text:
        assert re.search(r"\$\{?\(?[A-Z_]+", text), f"{name} carries a plaintext value"
    assert not re.search(r"://[^/\s]*:[^$/\s]+@", text), f"{name} has a password in a URL"


# --- compose ----------------------------------------------------------------------------------------


def ours(services: dict[str, Doc], command: str) -> dict[str, Doc]:
    """The services of our image running `threadline <command>`."""
    return {name: s for name, s in services.items()
            if str(s.get("image", "")).startswith("threadline") and s["command"][0] == command}


def worker_services() -> dict[str, Doc]:
    return ours(compose()["services"], "worker")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_compose_redis_is_persistent_protected_and_checked() -> None:
    redis_service = compose()["services"]["redis"]
    command = " ".join(redis_service["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    # the password comes from the container's environment at run time, not from the compose file
    assert re.search(r'--requirepass "?\$\$\{?REDIS_PASSWORD', command), command
    env = redis_service["environment"]
    assert set(env) <= DEPLOY_ONLY and env["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD")
    test = " ".join(redis_service["healthcheck"]["test"])
    assert "redis-cli" in test and "ping" in test.lower() and " -a " not in test
    assert any(volume.endswith(":/data") for volume in redis_service["volumes"])
    assert_pinned(redis_service["image"])
    for name, value in env.items():
        assert_no_plaintext_secret(name, value)


def test_compose_workers_wait_for_redis_read_env_file_and_stop_gracefully() -> None:
    services = worker_services()
    assert len(services) >= 2, "a group for model calls and one for the fast stages"
    for name, service in services.items():
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert ".env" in service["env_file"], name
        assert seconds(service["stop_grace_period"]) >= MIN_GRACE_S, name
        assert_pinned(service["image"], ours=True)
        build = service["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file() and (context / ".dockerignore").is_file(), name
        for variable, value in service["environment"].items():
            assert variable in KNOWN, f"{name}: {variable} is no Threadline setting"
            assert_no_plaintext_secret(variable, value)
        assert service["environment"]["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD"), name


def assert_groups_serve_every_queue(groups: dict[str, list[str]]) -> None:
    served: set[str] = set()
    for name, group_queues in groups.items():
        assert group_queues, f"{name} serves every queue: name them, per group"
        assert "control" in group_queues, f"{name} does not serve control: cancels would wait"
        assert set(group_queues) <= set(all_queues(DEFAULT_GRAPH)), f"{name}: unknown queues {group_queues}"
        served |= set(group_queues)
    assert served == set(all_queues(DEFAULT_GRAPH)), f"no group serves {set(all_queues(DEFAULT_GRAPH)) - served}"


def test_compose_worker_groups_serve_every_queue() -> None:
    assert_groups_serve_every_queue({name: queue_flags(s["command"]) for name, s in worker_services().items()})


def test_compose_gateway_waits_for_redis_and_is_checked_on_its_healthz() -> None:
    services = compose()["services"]
    (gateway,) = ours(services, "gateway").values()
    command = gateway["command"]
    port = int(flag(command, "--port"))
    assert flag(command, "--host") == "0.0.0.0", "else it answers only inside its container"
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert ".env" in gateway["env_file"] and seconds(gateway["stop_grace_period"]) >= MIN_GRACE_S
    assert_pinned(gateway["image"], ours=True)
    # the image it runs has the gateway's extra: the same build as the workers'
    assert gateway["build"] == next(iter(worker_services().values()))["build"]
    assert "gateway" in gateway["build"]["args"]["EXTRAS"].split(",")
    assert [p.rsplit(":", 1)[1] for p in gateway["ports"]] == [str(port)]
    assert all(p.startswith("127.0.0.1:") for p in gateway["ports"]), "not on every interface of the host"
    test = gateway["healthcheck"]["test"]
    assert test[:2] == ["CMD", Path(installed_healthcheck()).name]
    assert flag(test, "--url") == f"http://127.0.0.1:{port}/healthz"
    for variable, value in gateway["environment"].items():
        assert variable in KNOWN, f"gateway: {variable} is no Threadline setting"
        assert_no_plaintext_secret(variable, value)
    assert gateway["environment"]["REDIS_URL"] == next(iter(worker_services().values()))["environment"]["REDIS_URL"]


def test_env_example_names_only_known_variables_and_holds_no_secret() -> None:
    text = (DEPLOY / ".env.example").read_text()
    entries = re.findall(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", text, flags=re.M)
    names = {name for _, name, _ in entries}
    assert names - KNOWN <= DEPLOY_ONLY, f"unknown: {names - KNOWN - DEPLOY_ONLY}"
    assert names >= CONVENTIONAL_KEY_NAMES
    active = {name: value for comment, name, value in entries if not comment}
    assert active == {"REDIS_PASSWORD": ""}, "only the required REDIS_PASSWORD, empty; the rest commented out"
    interpolated = set(re.findall(r"\$\{([A-Z_]+)", (DEPLOY / "compose.yaml").read_text()))
    assert interpolated <= names, f"compose.yaml interpolates {interpolated - names}, not in .env.example"
    assert ".env" in (DEPLOY / ".gitignore").read_text().split()


# --- the image --------------------------------------------------------------------------------------


def test_dockerignore_keeps_local_state_and_secrets_out_of_the_build_context() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        excluded = False
        for pattern in patterns:  # the last matching pattern wins; `!` re-includes
            negate, glob = pattern.startswith("!"), pattern.lstrip("!")
            if any(fnmatch(p, glob) or (glob.startswith("**/") and fnmatch(p, glob[3:])) for p in prefixes):
                excluded = not negate
        return excluded

    for path in (".venv/bin/python", ".git/HEAD", ".threadline/data", "workers/__pycache__/x.pyc",
                 "deploy/.env", ".env", "tests/conftest.py"):
        assert ignored(path), path
    for path in ("pyproject.toml", "README.md", "pipeline/stages.py", "workers/storage/scripts/finish.lua",
                 "deploy/healthcheck.py"):
        assert not ignored(path), f"the image needs {path}"


def test_dockerfile_runs_as_its_user_with_a_data_dir_it_owns_and_a_healthcheck() -> None:
    (from_arg,) = [args for args in instructions("ARG") if args.startswith("PYTHON_IMAGE=")]
    assert instructions("FROM") == ["${PYTHON_IMAGE}"]
    assert_pinned(from_arg.split("=", 1)[1])
    user = instructions("USER")[-1].split(":")[0]
    assert user not in ("root", "0")
    assert any(re.search(rf"useradd .*\b{user}$", run) for run in instructions("RUN"))
    data_dir = dockerfile_env()["TL_DATA_DIR"]
    assert any(re.search(rf"chown {user}(:\w+)? {re.escape(data_dir)}\b", run) for run in instructions("RUN"))
    (healthcheck,) = instructions("HEALTHCHECK")
    assert re.search(rf'CMD \["{re.escape(Path(installed_healthcheck()).name)}"', healthcheck)
    assert re.search(r"--start-period=\d+s", healthcheck)
    assert instructions("ENTRYPOINT") == ['["threadline"]'], "the supervisor is PID 1: the health check's --parent"
    (exposed,) = instructions("EXPOSE")
    assert exposed.split() == [dockerfile_env()["TL_METRICS_PORT"], str(GATEWAY_PORT)], "/metrics and the gateway"
    (extras,) = [args for args in instructions("ARG") if args.startswith("EXTRAS=")]
    assert {"providers", "gateway"} <= set(extras.split("=", 1)[1].split(",")), "one image for workers and gateway"


# --- Kubernetes -------------------------------------------------------------------------------------


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"].items() <= labels.items())


def worker_deployments() -> list[Doc]:
    return [d for d in of_kind("Deployment") if pod_spec(d)["containers"][0]["args"][0] == "worker"]


def test_worker_deployments_have_probes_resources_and_grace() -> None:
    assert {d["metadata"]["name"] for d in of_kind("Deployment")} == {"worker-invoke", "worker-fast", "gateway"}
    deployments = worker_deployments()
    assert {d["metadata"]["name"] for d in deployments} == {"worker-invoke", "worker-fast"}
    data_dir = dockerfile_env()["TL_DATA_DIR"]
    for deployment in deployments:
        name, spec = deployment["metadata"]["name"], pod_spec(deployment)
        assert selects(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
        assert spec["terminationGracePeriodSeconds"] >= MIN_GRACE_S, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        (container,) = spec["containers"]
        assert_pinned(container["image"], ours=True)
        assert probe_paths(container) == PROBES, f"{name}: {probe_paths(container)}"
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], name
        if container["securityContext"]["readOnlyRootFilesystem"]:
            assert data_dir in {m["mountPath"] for m in container["volumeMounts"]}, f"{name}: {data_dir} read-only"


#: Where each probe of a worker container points: liveness and start-up never ask Redis (an outage
#: makes pods unready, it must not restart them); readiness does.
PROBES = {"startupProbe": "/livez", "readinessProbe": "/healthz", "livenessProbe": "/livez"}


def probe_paths(container: Doc) -> dict[str, str]:
    """Each probe's HTTP path, once checked to aim at the port the supervisor serves on."""
    port = int({v["name"]: v.get("value") for v in container["env"]}["TL_METRICS_PORT"])
    named_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    paths = {}
    for probe in PROBES:
        get = container[probe]["httpGet"]
        assert named_ports.get(get["port"], get["port"]) == port, f"{probe} aims at {get['port']}, not {port}"
        assert get["path"] in metrics.PATHS, f"{probe}: {get['path']} is not served"
        paths[probe] = get["path"]
    return paths


def test_worker_deployments_read_only_known_settings_and_secrets_by_reference() -> None:
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in of_kind("Secret")}
    settings = named("ConfigMap", "threadline-settings")["data"]
    assert set(settings) <= KNOWN
    for deployment in worker_deployments():
        (container,) = pod_spec(deployment)["containers"]
        for variable in container["env"]:
            assert variable["name"] in KNOWN, variable
            if "value" in variable:
                assert_no_plaintext_secret(variable["name"], variable["value"])
            else:
                ref = variable["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], ref
        sources = {next(iter(s)): next(iter(s.values()))["name"] for s in container["envFrom"]}
        assert sources == {"configMapRef": "threadline-settings", "secretRef": "threadline-models"}
        assert set(secrets["threadline-models"]) <= KNOWN
        assert "REDIS_URL" in {v["name"] for v in container["env"]}, "else each pod starts an embedded server"


def test_worker_deployments_serve_every_queue() -> None:
    assert_groups_serve_every_queue({d["metadata"]["name"]: queue_flags(pod_spec(d)["containers"][0]["args"])
                                     for d in worker_deployments()})


def test_each_worker_group_has_a_disruption_budget_of_its_own() -> None:
    budgets = of_kind("PodDisruptionBudget")
    pods = [(d["kind"], d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"])
            for d in of_kind("Deployment") + of_kind("StatefulSet")]
    for kind, name, labels in pods:
        covering = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        if kind == "Deployment":
            assert len(covering) == 1, f"{name}: {len(covering)} budgets"
            assert covering[0]["spec"].get("maxUnavailable", 0) >= 1 or covering[0]["spec"].get("minAvailable")
        else:
            assert not covering, "a budget on the single Redis would block every drain of its node"


#: Where each probe of the gateway points: readiness asks Redis (`/healthz`); liveness and start-up
#: only that the app answers HTTP (its OpenAPI document), so that a Redis outage never restarts it.
GATEWAY_PROBES = {"startupProbe": "/openapi.json", "readinessProbe": "/healthz", "livenessProbe": "/openapi.json"}


def test_gateway_deployment_has_probes_resources_grace_and_a_service() -> None:
    deployment = named("Deployment", "gateway")
    spec = pod_spec(deployment)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"], labels)
    assert spec["terminationGracePeriodSeconds"] >= MIN_GRACE_S
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert_pinned(container["image"], ours=True)
    args = container["args"]
    assert args[0] == "gateway" and flag(args, "--host") == "0.0.0.0"
    port = int(flag(args, "--port"))
    assert port == GATEWAY_PORT
    named_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in GATEWAY_PROBES.items():
        get = container[probe]["httpGet"]
        assert named_ports.get(get["port"], get["port"]) == port, f"{probe} aims at {get['port']}, not {port}"
        assert get["path"] == path, probe
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in of_kind("Secret")}
    for variable in container["env"]:
        assert variable["name"] in KNOWN, variable
        ref = variable["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secrets[ref["name"]], ref
    assert "REDIS_URL" in {v["name"] for v in container["env"]}
    # it calls no model: no model keys in its environment
    assert container["envFrom"] == [{"configMapRef": {"name": "threadline-settings"}}]
    service = named("Service", "threadline-gateway")
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    assert {named_ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]} == {port}


@pytest.mark.integration
def test_the_gateway_serves_its_probe_paths_and_only_readiness_asks_redis(redis_url: str) -> None:
    from fastapi.testclient import TestClient

    from threadline.workers.gateway.app import create_app

    settings = Settings.from_env({"TL_PREFIX": f"tld{uuid.uuid4().hex[:6]}"})
    with TestClient(create_app(settings, redis_url)) as up:
        for path in sorted(set(GATEWAY_PROBES.values())):
            assert up.get(path).status_code == 200, path
    dead_redis = f"redis://127.0.0.1:{closed_port()}/0"
    with TestClient(create_app(settings, dead_redis)) as down:
        assert down.get("/healthz").status_code == 503
        assert down.get(GATEWAY_PROBES["livenessProbe"]).status_code == 200


def test_secrets_in_the_repository_are_empty_and_never_applied() -> None:
    for secret in of_kind("Secret"):
        assert secret["_file"].name == "secret.example.yaml"
        assert not secret.get("data"), "base64 is not encryption"
        assert all(value == "" for value in secret["stringData"].values()), secret["metadata"]["name"]
    for kustomization in K8S.rglob("kustomization.yaml"):
        assert "secret.example.yaml" not in yaml.safe_load(kustomization.read_text())["resources"]


def test_redis_statefulset_persists_with_aof_and_a_password_from_the_secret() -> None:
    statefulset = named("StatefulSet", "threadline-redis")
    (container,) = pod_spec(statefulset)["containers"]
    args = " ".join(container["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args and "--maxmemory-policy noeviction" in args
    assert "--requirepass $(REDIS_PASSWORD)" in args
    env = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"]}
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == {"name": "threadline-redis", "key": "REDIS_PASSWORD"}
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    data_dir = container["args"][container["args"].index("--dir") + 1]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in container["volumeMounts"]
    assert "redis-cli" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert_pinned(container["image"])
    service = named("Service", statefulset["spec"]["serviceName"])
    assert selects({"matchLabels": service["spec"]["selector"]}, statefulset["spec"]["template"]["metadata"]["labels"])


def test_keda_scales_the_invoke_workers_on_the_invoke_queue_list() -> None:
    scaled = named("ScaledObject", "worker-invoke")
    target = named("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert "invoke" in queue_flags(pod_spec(target)["containers"][0]["args"])
    assert scaled["spec"]["minReplicaCount"] >= 1, "control and compact are served there too"
    (trigger,) = scaled["spec"]["triggers"]
    prefix = named("ConfigMap", "threadline-settings")["data"]["TL_PREFIX"]
    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == Keys(prefix).queue("invoke")
    namespace = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]
    host = trigger["metadata"]["address"].split(":")[0]
    assert host.startswith(f"{named('Service', 'threadline-redis')['metadata']['name']}.{namespace}.svc")
    auth = named("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "threadline-redis",
                                                "key": "REDIS_PASSWORD"}]
    (patch,) = yaml.safe_load((K8S / "keda" / "kustomization.yaml").read_text())["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "worker-invoke"}
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}], "the HPA owns replicas"


# --- Grafana ----------------------------------------------------------------------------------------


def defined_series(redis_url: str) -> set[str]:
    """Every series name the workers and the supervisor's endpoint expose: the worker processes'
    metrics, and the families the queue collector reads from a (real, empty) prefix."""
    families = [m for c in (metrics.TURNS, metrics.STAGE_SECONDS, metrics.STAGES_RUNNING, metrics.REDELIVERIES,
                            metrics.TAKEOVERS, metrics.CANCEL_SECONDS, metrics.INPUT_TOKENS, metrics.OUTPUT_TOKENS,
                            metrics.MODEL_REQUESTS, metrics.CONSUMERS, metrics.WORKER_READY, metrics.ORPHANS_REQUEUED,
                            metrics.TOKEN_COUNTS)
                for m in c.describe()]
    client = redis.Redis.from_url(redis_url)
    try:
        operations = Operations(client, Keys(f"tlg{uuid.uuid4().hex[:6]}"))
        families += list(metrics_server.QueueCollector(operations).collect())
    finally:
        client.close()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + suffix for f in families for suffix in suffixes[f.type]}


def test_grafana_dashboard_queries_only_metrics_the_code_defines(redis_url: str) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "threadline.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 10
    defined = defined_series(redis_url)
    used = {name for expr in exprs for name in re.findall(r"\bthreadline_[a-z_]+", expr)}
    assert used <= defined, f"not defined: {used - defined}"
    # every family a worker or the supervisor exposes is on the dashboard
    assert {re.sub(r"_(bucket|count|sum)$", "", n) for n in used} >= {
        re.sub(r"_(bucket|count|sum)$", "", n) for n in defined}, "a metric without a panel"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# --- systemd ----------------------------------------------------------------------------------------


def test_systemd_unit_is_hardened_and_stops_the_supervisor_gracefully() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "threadline-worker.service").read_text())
    service = unit["Service"]
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) >= MIN_GRACE_S
    assert service["User"] not in ("root", "0") and service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict" and service["ProtectHome"] == "yes" and service["PrivateTmp"] == "yes"
    assert service["CapabilityBoundingSet"] == "" and service["EnvironmentFile"]


# --- the health check, against a real supervisor --------------------------------------------------


def healthcheck(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = subprocess.run([sys.executable, str(HEALTHCHECK), *args], env={**os.environ, **(env or {})},
                            capture_output=True, text=True, timeout=30)
    return result.returncode, result.stdout.strip()


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def metrics_port() -> int:
    return closed_port()


@pytest.fixture
def supervisor(redis_url: str, metrics_port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`threadline worker`, as the image's ENTRYPOINT runs it, on a prefix of its own."""
    prefix = f"tld{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": redis_url, "TL_PREFIX": prefix, "TL_LOG_LEVEL": "WARNING",
           "TL_METRICS_PORT": str(metrics_port), "PYTHONPATH": str(ROOT)}
    threadline = shutil.which("threadline", path=str(Path(sys.executable).parent)) or "threadline"
    process = subprocess.Popen([threadline, "worker", "--processes", "1", "--threads", "2"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.mark.integration
@pytest.mark.slow  # ~20 s: a supervisor's workers and a Redis restart
def test_healthcheck_follows_the_supervisor_and_redis(supervisor: subprocess.Popen[bytes], redis_url: str,
                                                      metrics_port: int) -> None:
    parent = str(supervisor.pid)
    healthy = poll(lambda: healthcheck("--parent", parent, "--min-age-s", "0.5", env={"REDIS_URL": redis_url})
                   == (0, "healthy"), timeout_s=30, interval_s=0.3)
    assert healthy, healthcheck("--parent", parent, "--min-age-s", "0.5", env={"REDIS_URL": redis_url})
    # the manifests' HTTP probes, against the supervisor itself
    paths = {path for d in worker_deployments() for path in probe_paths(pod_spec(d)["containers"][0]).values()}
    for path in sorted(paths):
        assert poll(lambda path=path: http_status(metrics_port, path) == 200, timeout_s=15), path
    code, out = healthcheck("--parent", parent, "--min-age-s", "600", env={"REDIS_URL": redis_url})
    assert code == 1 and "none up for 600 s" in out, out
    # `--url`, as the gateway's container runs it: any server's health endpoint, 2xx or not
    assert healthcheck("--url", f"http://127.0.0.1:{metrics_port}/healthz") == (0, "healthy")
    code, out = healthcheck("--url", f"http://127.0.0.1:{metrics_port}/nothing-here")
    assert code == 1 and "answered 404" in out, out
    code, out = healthcheck("--url", f"http://127.0.0.1:{closed_port()}/healthz", "--timeout-s", "1")
    assert code == 1 and "did not answer" in out, out

    dead_redis = f"redis://:hunter2-not-a-secret@127.0.0.1:{closed_port()}/0"
    code, out = healthcheck("--parent", parent, "--min-age-s", "0", env={"REDIS_URL": dead_redis})
    assert code == 1 and "redis did not answer" in out and "hunter2" not in out, out
    live = healthcheck("--live", "--parent", parent, "--min-age-s", "0", env={"REDIS_URL": dead_redis})
    assert live == (0, "healthy"), "liveness ignores Redis"
    code, out = healthcheck("--parent", parent, "--min-age-s", "0", env={"REDIS_URL": ""})
    assert code == 1 and "REDIS_URL is not set" in out

    # SIGTERM, as `docker stop` and the kubelet send it: the supervisor exits within the grace period.
    # Elapsed time is the right clock here (it is what they time before their SIGKILL); the margin is
    # the design's: the supervisor's own timers end it within TL_SHUTDOWN_GRACE_S + KILL_MARGIN_S
    # + STACKS_S, and every stop timeout is at least twice that (MIN_GRACE_S, checked above)
    grace_s = min(seconds(s["stop_grace_period"]) for s in worker_services().values())
    assert grace_s >= MIN_GRACE_S
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=grace_s) == 0  # TimeoutExpired: still running at the kill
    code, out = healthcheck("--live", "--parent", parent)
    assert code == 1 and "no worker process" in out


# --- the real tools, when this machine has them ----------------------------------------------------


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", ["base", "keda"])
def test_kustomizations_render(overlay: str) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert all(doc["metadata"].get("namespace") == "threadline" for doc in rendered if doc["kind"] != "Namespace")
    invoke = [d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "worker-invoke"]
    assert ("replicas" in invoke[0]["spec"]) == (overlay == "base"), "KEDA's HPA owns the invoke replicas"
    assert not any(doc["kind"] == "Secret" for doc in rendered)


def docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not docker_compose(), reason="docker compose is not installed")
def test_compose_config_is_valid(tmp_path: Path) -> None:
    # a copy beside a throwaway .env: compose reads env_file `.env` next to the file
    env_file = tmp_path / ".env"
    env_file.write_text("REDIS_PASSWORD=0123456789abcdef\n")
    shutil.copy(DEPLOY / "compose.yaml", tmp_path / "compose.yaml")
    result = subprocess.run(["docker", "compose", "--env-file", str(env_file), "-f", str(tmp_path / "compose.yaml"),
                             "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
