"""docker-compose.yml, loaded by compose-check (scripts/compose-check: compose-go's LoadProject, what
`docker compose config` runs, with the schema and consistency checks; no Docker engine needed), and
checked against the worker's settings, the Dockerfile, the key job and the Prometheus config."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_app.bus.policy_file import load_policy
from stream_app.bus.signing import KeyRing, Signer
from stream_app.commands.notify import NOTIFY_SETTINGS
from stream_app.worker.settings import SETTINGS, WorkerSettings
from tests.conftest import kafka_local

from .tools import REPO, run, tool

pytestmark = pytest.mark.deploy

COMPOSE = REPO / "docker-compose.yml"
WORKER_VARS = {var for _, var, _, _ in SETTINGS}
NOTIFY_VARS = {var for _, var, _, _ in NOTIFY_SETTINGS}
KAFKA_VARS = {"KAFKA_BOOTSTRAP_SERVERS", "KAFKA_SECURITY_PROTOCOL", "KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME",
              "KAFKA_SASL_PASSWORD", "KAFKA_SSL_CAFILE", "KAFKA_SSL_CERTFILE", "KAFKA_SSL_KEYFILE",
              "KAFKA_SSL_CHECK_HOSTNAME"}


@cache
def model() -> dict[str, Any]:
    """The compose project as compose-go resolves it (anchors merged, paths absolute, all profiles)."""
    result = run(tool("compose-check"), str(COMPOSE))
    return dict(json.loads(result.stdout))


def services() -> dict[str, Any]:
    return dict(model()["services"])


def workers() -> dict[str, Any]:
    return {name: s for name, s in services().items() if s.get("command") in (None, ["worker"])
            and s.get("image", "").startswith("loopwarden")}


def test_compose_loader_accepts_the_file() -> None:
    """compose-go loads the file: schema, interpolation, consistency (every depends_on, volume and
    network a service names exists)."""
    assert set(services()) == {"kafka", "kafka-init", "keys-init", "worker-1", "worker-2", "prometheus", "alertmanager",
                               "grafana", "notify"}


@pytest.mark.parametrize(("service", "error"), [
    ("depends_on: {b: {condition: service_healthy}}", 'depends on undefined service "b"'),  # consistency
    ("volumes: [missing:/data]", "undefined volume missing"),                                # consistency
    ("healthcheck: {tset: [CMD, 'true']}", "additional properties 'tset' not allowed"),       # schema
])
def test_compose_loader_refuses_broken_files(tmp_path: Path, service: str, error: str) -> None:
    """The validator is real: what `docker compose config` refuses, it refuses."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(f"services:\n  a:\n    image: busybox\n    {service}\n")
    result = run(tool("compose-check"), check=False, cwd=tmp_path)
    assert result.returncode == 1 and error in result.stderr


def test_no_obsolete_version_key() -> None:
    """The Compose Specification has no top-level `version:`."""
    assert "version" not in yaml.safe_load(COMPOSE.read_text())


def test_kafka_is_the_official_image_at_the_local_scripts_version() -> None:
    """The broker and the topic job run apache/kafka at the version scripts/kafka_local runs for tests."""
    image = f"apache/kafka:{kafka_local.DEFAULT_VERSION}"
    assert services()["kafka"]["image"] == image and services()["kafka-init"]["image"] == image


def test_kafka_is_kraft_with_an_internal_and_a_host_listener() -> None:
    """KRaft (combined broker and controller), an INTERNAL listener the containers use and a HOST
    listener published on the host and advertised as localhost."""
    kafka = services()["kafka"]
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    listeners = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert set(listeners) == {"INTERNAL", "HOST"}
    host_port = listeners["HOST"].rsplit(":", 1)[1]
    assert listeners["HOST"].startswith("localhost:")
    assert [p["published"] for p in kafka["ports"] if str(p["target"]) == host_port] == [host_port]
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "INTERNAL"
    assert "KAFKA_BOOTSTRAP_SERVERS" not in env
    for name in workers():
        assert services()[name]["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == listeners["INTERNAL"]
    assert kafka["volumes"][0]["target"] == env["KAFKA_LOG_DIRS"]


def test_dependencies_wait_for_health_or_completion() -> None:
    """Every depends_on has a condition; a service waited on as healthy has a healthcheck."""
    for name, service in services().items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert spec["condition"] in ("service_healthy", "service_completed_successfully"), (name, dependency)
            if spec["condition"] == "service_healthy":
                assert services()[dependency].get("healthcheck"), dependency
    assert services()["kafka-init"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in workers():
        assert services()[name]["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
        assert services()[name]["depends_on"]["keys-init"]["condition"] == "service_completed_successfully"
        assert services()[name]["healthcheck"]["test"][0] == "CMD"


@pytest.mark.parametrize("name", sorted(workers()))
def test_worker_environment_is_real_settings(name: str) -> None:
    """Every LOOPWARDEN_* variable a worker gets is a worker setting (SETTINGS), the KAFKA_* ones are
    connection settings, and the whole environment passes the worker's own validation."""
    env = services()[name]["environment"]
    assert {v for v in env if v.startswith("LOOPWARDEN_")} <= WORKER_VARS
    assert {v for v in env if v.startswith("KAFKA_")} <= KAFKA_VARS
    settings = WorkerSettings.from_env(env)
    assert settings.create_topics is False and settings.standby_replicas == 1


@pytest.mark.parametrize("name", sorted(workers()))
def test_worker_state_dir_is_its_own_volume_and_policy_is_mounted(name: str) -> None:
    """LOOPWARDEN_STATE_DIR is a named volume of this worker alone; LOOPWARDEN_POLICY is a read-only
    bind mount of a policy file the worker accepts."""
    service = services()[name]
    env = service["environment"]
    mounts = {v["target"]: v for v in service["volumes"]}
    state = mounts[env["LOOPWARDEN_STATE_DIR"]]
    assert state["type"] == "volume" and state["source"] in model()["volumes"]
    others = [v["source"] for other, s in workers().items() if other != name for v in s["volumes"]]
    assert state["source"] not in others
    policy = mounts[env["LOOPWARDEN_POLICY"]]
    assert policy["type"] == "bind" and policy["read_only"] is True
    load_policy(policy["source"])


@pytest.mark.parametrize("name", sorted(workers()))
def test_worker_signing_key_is_the_read_only_keys_volume(name: str) -> None:
    """LOOPWARDEN_SIGNING_KEY is a file in a read-only mount of the named volume keys-init writes."""
    key_dir = str(Path(services()[name]["environment"]["LOOPWARDEN_SIGNING_KEY"]).parent)
    (mount,) = [v for v in services()[name]["volumes"] if v["target"] == key_dir]
    assert mount["type"] == "volume" and mount["read_only"] is True and mount["source"] in model()["volumes"]
    (written,) = [v for v in services()["keys-init"]["volumes"] if v["source"] == mount["source"]]
    assert not written.get("read_only")


def test_keys_job_makes_the_signing_key_once(tmp_path: Path) -> None:
    """keys-init's script, run with the real `loopwarden keys generate` (the volume a temporary
    directory, chown a stand-in that records its arguments), writes the private key the workers read
    (mode 0600, handed to the image's user) and its public key; a second run leaves them alone."""
    init = services()["keys-init"]
    assert init["entrypoint"] == ["/bin/sh", "-ec"]
    (volume,) = init["volumes"]
    key_name = Path(services()["worker-1"]["environment"]["LOOPWARDEN_SIGNING_KEY"]).name
    keys, stubs = tmp_path / "keys", tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "chown.jsonl"
    (stubs / "chown").write_text(f'#!/usr/bin/env python3\nimport json, sys\nopen("{calls}", "a").write(json.dumps(sys.argv[1:]) + "\\n")\n')
    (stubs / "chown").chmod(0o755)
    script = init["command"][0].replace(volume["target"], str(keys))
    path = f"{stubs}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    def run_job() -> None:
        subprocess.run(["/bin/sh", "-ec", script], env={**os.environ, "PATH": path}, check=True, timeout=60)

    run_job()
    private = keys / key_name
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    signer = Signer.from_file(private)
    value = b'{"action": "halt"}'
    assert KeyRing.from_paths([private.with_suffix(".pub")]).verify(value, signer.headers(value)) == signer.key_id
    user = [args for op, args in dockerfile() if op == "USER"][-1]
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [[user, str(private)]]
    before = private.read_bytes()
    run_job()
    assert private.read_bytes() == before and len(calls.read_text().splitlines()) == 1


@pytest.mark.parametrize("name", sorted(workers()))
def test_workers_trust_the_operator_key_keys_init_makes(name: str, tmp_path: Path) -> None:
    """`loopwarden halt` works against compose: the workers' LOOPWARDEN_OPERATOR_KEYS is the operator
    public key keys-init writes into the keys volume (the script, run for real, makes it)."""
    operator_keys = Path(services()[name]["environment"]["LOOPWARDEN_OPERATOR_KEYS"])
    (mount,) = [v for v in services()[name]["volumes"] if v["target"] == str(operator_keys.parent)]
    (written,) = services()["keys-init"]["volumes"]
    assert mount["source"] == written["source"]
    script = services()["keys-init"]["command"][0].replace(written["target"], str(tmp_path)).replace("chown", "true")
    subprocess.run(["/bin/sh", "-ec", script], check=True, timeout=60,
                   env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    signer = Signer.from_file(tmp_path / "operator.key")
    value = b'{"kind": "operator"}'
    assert KeyRing.from_paths([tmp_path / operator_keys.name]).verify(value, signer.headers(value)) == signer.key_id


def test_notify_posts_only_alerts_the_workers_signed() -> None:
    """notify's LOOPWARDEN_WORKER_KEYS is the workers' public key, from the same keys volume, read-only."""
    notify = services()["notify"]
    keys = Path(notify["environment"]["LOOPWARDEN_WORKER_KEYS"])
    (mount,) = [v for v in notify["volumes"] if v["target"] == str(keys.parent)]
    worker_key = Path(services()["worker-1"]["environment"]["LOOPWARDEN_SIGNING_KEY"])
    (worker_mount,) = [v for v in services()["worker-1"]["volumes"] if v["target"] == str(worker_key.parent)]
    assert mount["source"] == worker_mount["source"] and mount["read_only"] is True
    assert keys.name == worker_key.with_suffix(".pub").name
    assert "keys-init" in notify["depends_on"]


def test_grafana_shows_the_charts_dashboard_on_the_compose_prometheus() -> None:
    """Grafana provisions the Helm chart's own dashboard file (one file for both) and the compose
    Prometheus as its data source; the dashboard's queries are checked against the worker's metrics by
    test_helm and against real series by test_prometheus_scrape."""
    grafana = services()["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    mounts = {v["target"]: v for v in grafana["volumes"]}
    dashboard = mounts["/var/lib/grafana/dashboards/loopwarden.json"]
    assert dashboard["source"] == str(REPO / "helm/loopwarden/files/dashboards/loopwarden.json")
    provisioning = Path(mounts["/etc/grafana/provisioning"]["source"])
    assert provisioning == REPO / "deploy/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    prometheus_port = services()["prometheus"]["ports"][0]["target"]
    assert (source["type"], source["url"]) == ("prometheus", f"http://prometheus:{prometheus_port}")
    (provider,) = yaml.safe_load((provisioning / "dashboards/loopwarden.yaml").read_text())["providers"]
    assert provider["options"]["path"] == str(Path(dashboard["target"]).parent)
    assert json.loads(Path(dashboard["source"]).read_text())["uid"] == "loopwarden"
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_metrics_port_is_the_prometheus_scrape_target() -> None:
    """Prometheus' loopwarden job scrapes each worker at its LOOPWARDEN_METRICS_PORT, listening on all
    interfaces; the job name is the one the alert rules select."""
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for sc in jobs["loopwarden"]["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, service in workers().items():
        env = service["environment"]
        assert env["LOOPWARDEN_METRICS_HOST"] == "0.0.0.0"
        expected.add(f"{service.get('hostname', name)}:{env['LOOPWARDEN_METRICS_PORT']}")
        assert name == service.get("hostname", name)  # the service name resolves too
    assert targets == expected
    alertmanagers = {t for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"] for t in sc["targets"]}
    assert alertmanagers == {f"alertmanager:{services()['alertmanager']['ports'][0]['target']}"}


def test_prometheus_and_alertmanager_mount_the_project_files() -> None:
    """Prometheus mounts the single rules file (the one the Helm chart embeds) and its config;
    Alertmanager its config."""
    prometheus = {v["target"]: v["source"] for v in services()["prometheus"]["volumes"]}
    assert prometheus["/etc/prometheus/rules/loopwarden-rules.yml"] == str(REPO / "helm/loopwarden/files/loopwarden-rules.yml")
    assert prometheus["/etc/prometheus/prometheus.yml"] == str(REPO / "deploy/prometheus/prometheus.yml")
    alertmanager = {v["target"]: v["source"] for v in services()["alertmanager"]["volumes"]}
    assert alertmanager["/etc/alertmanager/alertmanager.yml"] == str(REPO / "deploy/alertmanager/alertmanager.yml")
    for name in ("prometheus", "alertmanager"):
        assert re.fullmatch(r"prom/[a-z]+:v\d+\.\d+\.\d+", services()[name]["image"])


def test_notify_environment_is_real_settings() -> None:
    """The optional notify service uses notifier settings (NOTIFY_SETTINGS) and the workers' alerts topic."""
    env = services()["notify"]["environment"]
    assert {v for v in env if v.startswith("LOOPWARDEN_")} <= NOTIFY_VARS
    assert services()["notify"]["profiles"] == ["notify"] and services()["notify"]["command"] == ["notify"]
    assert env["LOOPWARDEN_ALERTS_TOPIC"] == services()["worker-1"]["environment"]["LOOPWARDEN_ALERTS_TOPIC"]


def test_topic_job_creates_the_workers_topics(tmp_path: Path) -> None:
    """kafka-init's script, run with a stand-in kafka-topics.sh that records its arguments, creates
    the five topics and the two compacted changelogs, with the partitions and replication the workers
    expect (the same names the worker's ensure_topics would create)."""
    init = services()["kafka-init"]
    assert init["entrypoint"] == ["/bin/bash", "-ec"]
    calls = tmp_path / "calls.jsonl"
    stub = tmp_path / "kafka-topics.sh"
    stub.write_text(f'#!/usr/bin/env python3\nimport json, sys\nopen("{calls}", "a").write(json.dumps(sys.argv[1:]) + "\\n")\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    script = init["command"][0].replace("/opt/kafka/bin/kafka-topics.sh", str(stub))
    subprocess.run(["/bin/bash", "-ec", script], env={**os.environ, **init["environment"]}, check=True)

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    created = {}
    for line in calls.read_text().splitlines():
        args = json.loads(line)
        if "--create" in args:
            configs = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
            created[flag(args, "--topic")] = (int(flag(args, "--partitions")),
                                              int(flag(args, "--replication-factor")), configs)
            assert flag(args, "--bootstrap-server") == "kafka:19092"
    for name in workers():
        settings = WorkerSettings.from_env(services()[name]["environment"])
        expected = {topic: (settings.partitions, settings.replication_factor, [])
                    for topic in (settings.telemetry_topic, settings.control_topic, settings.alerts_topic,
                                  settings.dlq_topic)}
        expected[settings.changelog_topic] = (settings.partitions, settings.replication_factor,
                                              ["cleanup.policy=compact"])
        assert settings.fleet_rules  # the rules across runs: the facts, the trees' and threads' changelogs
        expected[settings.facts_topic] = (settings.partitions, settings.replication_factor, [])
        for changelog in settings.fleet_changelog_topics.values():
            expected[changelog] = (settings.partitions, settings.replication_factor, ["cleanup.policy=compact"])
        expected[settings.scopes_topic] = (settings.partitions, settings.replication_factor, ["cleanup.policy=compact"])
        assert created == expected


# --------------------------------------------------------------------------------------------------
# The Dockerfile the workers are built from


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


def test_workers_run_the_image_built_from_the_dockerfile() -> None:
    """The worker and notify services build the repository's Dockerfile into one local image."""
    for name in [*workers(), "keys-init", "notify"]:
        service = services()[name]
        assert service["build"] == {"context": str(REPO), "dockerfile": "Dockerfile"}
        assert service["image"] == "loopwarden:local"


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    """Three stages on slim bases (the native engine's wheel, the virtualenv, the runtime), the final one
    running as a numeric non-root user, the worker as entrypoint, the state directory a volume and the
    metrics port exposed: and they agree with the worker's defaults and with compose."""
    instructions = dockerfile()
    stages = [args for op, args in instructions if op == "FROM"]
    assert len(stages) == 3 and all("-slim" in s for s in stages)
    assert stages[0].endswith(" AS native") and stages[1].endswith(" AS build")
    final = instructions[[i for i, (op, _) in enumerate(instructions) if op == "FROM"][-1]:]
    user = [args for op, args in final if op == "USER"]
    assert user and user[-1].split(":")[0].isdigit() and int(user[-1].split(":")[0]) >= 1000
    assert [json.loads(args) for op, args in final if op == "ENTRYPOINT"] == [["loopwarden"]]
    assert [json.loads(args) for op, args in final if op == "CMD"] == [["worker"]]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(args for op, args in final if op == "ENV")))
    assert {v for v in env if v.startswith("LOOPWARDEN_")} <= WORKER_VARS
    volumes = [v for op, args in final if op == "VOLUME" for v in json.loads(args)]
    assert volumes == [env["LOOPWARDEN_STATE_DIR"]]
    assert [args for op, args in final if op == "EXPOSE"] == [env["LOOPWARDEN_METRICS_PORT"]]
    for service in workers().values():
        assert service["environment"]["LOOPWARDEN_STATE_DIR"] == env["LOOPWARDEN_STATE_DIR"]
        assert service["environment"]["LOOPWARDEN_METRICS_PORT"] == env["LOOPWARDEN_METRICS_PORT"]


def test_the_image_ships_the_native_engine() -> None:
    """The native stage builds the wheel from native/ with the locked dependencies; the build stage
    installs it beside loopwarden[worker], so LOOPWARDEN_ENGINE=auto (the default) folds natively.
    (No Docker engine here: make install builds the same sources with the same maturin range.)"""
    instructions = dockerfile()
    starts = [i for i, (op, _) in enumerate(instructions) if op == "FROM"]
    native, build = instructions[starts[0]:starts[1]], instructions[starts[1]:starts[2]]
    runs = " ".join(args for op, args in native if op == "RUN")
    assert "maturin build --release --locked --out /wheels" in runs
    maturin = tomllib.loads((REPO / "native" / "pyproject.toml").read_text())["build-system"]["requires"]
    assert f"'{maturin[0]}'" in runs  # the same maturin range as pip install ./native
    assert ("COPY", "--from=native /wheels /wheels") in build
    assert any(op == "RUN" and "'.[worker]' /wheels/loopwarden_native-" in args for op, args in build)
    assert {name: default for name, _, default, _ in SETTINGS}["engine"] == "auto"


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    """Each path the build stage COPYs is let through .dockerignore (which excludes everything else)."""
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {src.rstrip("/") for op, args in dockerfile() if op == "COPY" and "--from" not in args
              for src in args.split()[:-1]}
    assert copied and copied <= allowed
    assert "native/target" not in allowed  # the build's own cargo output stays out of the context
    assert "*" in ignore


def test_the_docker_build_context_builds_the_package(tmp_path: Path) -> None:
    """What .dockerignore lets into the build context is enough for the Dockerfile's `pip install
    '.[worker]'`: the wheel built from it has the worker, the notifier, the schemas and the entry point.
    (No Docker engine here: the same pip step, outside a container.)"""
    import shutil
    import zipfile

    context = tmp_path / "context"
    context.mkdir()
    for line in (REPO / ".dockerignore").read_text().splitlines():
        if line.startswith("!"):
            relative = line[1:].rstrip("/")
            source, target = REPO / relative, context / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, target)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                             "-w", str(tmp_path / "dist"), str(context)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("loopwarden-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"stream_app/worker/main.py", "stream_app/commands/notify.py", "stream_app/_schemas/control.v1.json"} <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "loopwarden = stream_app.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
