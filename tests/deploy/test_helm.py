"""The Helm chart (helm/loopwarden), linted and rendered by the real helm binary, and its manifests
checked against what the worker reads: settings, policy path, signing and operator keys, metrics port,
state directory."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_app.bus.policy_file import load_policy
from stream_app.worker.settings import SETTINGS, WorkerSettings

from .tools import REPO, metric_names, run, tool, worker_series

pytestmark = pytest.mark.deploy

CHART = REPO / "helm/loopwarden"
RULES = CHART / "files/loopwarden-rules.yml"
DASHBOARD = CHART / "files/dashboards/loopwarden.json"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
# The chart's defaults plus the one value without a default (signing.existingSecret).
DEFAULTS = "default-values.yaml"
WORKER_VARS = {var for _, var, _, _ in SETTINGS}
RELEASE = "loopwarden"


@cache
def render(values_file: str | None = DEFAULTS, *sets: str) -> tuple[dict[str, Any], ...]:
    """`helm template` of the chart (release "loopwarden" in namespace "agents"), parsed; None renders
    the chart's values.yaml alone."""
    args = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", "agents"]
    if values_file:
        args += ["--values", str(CHART / "ci" / values_file)]
    for item in sets:
        args += ["--set", item]
    return tuple(doc for doc in yaml.safe_load_all(run(*args).stdout) if doc)


def render_fails(*args: str) -> str:
    result = run(tool("helm"), "template", RELEASE, str(CHART), *args, check=False)
    assert result.returncode != 0, result.stdout
    return result.stderr


def kinds(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: tuple[dict[str, Any], ...], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in kinds(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind, suffix, [d["metadata"]["name"] for d in found])
    return found[0]


def worker(docs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(StatefulSet, its worker container)."""
    sts = one(docs, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def scenario(values_file: str) -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "ci" / values_file).read_text()))


def volume_of(sts: dict[str, Any], mount: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


# Every render the checks below run on: each ci/ scenario, the chart's defaults among them (the bare
# chart does not render: it has no signing key).
ALL = SCENARIOS


# --------------------------------------------------------------------------------------------------
# helm lint and template


def test_scenarios_exist() -> None:
    """ci/ holds the default, a production-like, an ephemeral and a mutual-TLS scenario."""
    assert {"default-values.yaml", "production-values.yaml", "ephemeral-values.yaml", "mtls-values.yaml"} <= set(SCENARIOS)


@pytest.mark.parametrize("values_file", ALL)
def test_helm_lint(values_file: str) -> None:
    """`helm lint --strict` passes on every ci/ scenario (values.schema.json included)."""
    args = [tool("helm"), "lint", str(CHART), "--strict", "--values", str(CHART / "ci" / values_file)]
    assert "1 chart(s) linted, 0 chart(s) failed" in run(*args).stdout


@pytest.mark.parametrize("values_file", ALL)
def test_helm_template_renders_labelled_resources(values_file: str) -> None:
    """Every rendered resource carries the app.kubernetes.io labels from _helpers.tpl and lives in the
    release namespace."""
    docs = render(values_file)
    assert {"StatefulSet", "Service", "ConfigMap"} <= {d["kind"] for d in docs}
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "loopwarden" and labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"].startswith("loopwarden-")
        assert "app.kubernetes.io/version" in labels
        assert doc["metadata"]["namespace"] == "agents"


# --------------------------------------------------------------------------------------------------
# The worker as the chart runs it


@pytest.mark.parametrize("values_file", ALL)
def test_worker_environment_is_real_settings(values_file: str) -> None:
    """Every LOOPWARDEN_* variable the chart sets is a worker setting, and the environment (secrets
    stood in for) passes the worker's own validation, Kafka security settings included."""
    _, container = worker(render(values_file))
    env = env_of(container)
    assert {v for v in env if v.startswith("LOOPWARDEN_")} <= WORKER_VARS
    plain = {k: (v if isinstance(v, str) else "from-secret") for k, v in env.items()}
    WorkerSettings.from_env(plain)


@pytest.mark.parametrize("values_file", ALL)
def test_policy_configmap_is_mounted_where_the_worker_reads_it(values_file: str, tmp_path: Path) -> None:
    """LOOPWARDEN_POLICY names a file in a read-only mount of the policy ConfigMap, and that file is a
    policy the worker accepts."""
    docs = render(values_file)
    sts, container = worker(docs)
    policy_path = Path(env_of(container)["LOOPWARDEN_POLICY"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(policy_path.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    configmap = one(docs, "ConfigMap", volume["configMap"]["name"])
    text = configmap["data"][policy_path.name]
    path = tmp_path / policy_path.name
    path.write_text(text)
    load_policy(path)


def test_policy_values_become_the_policy_file() -> None:
    """The policy map in values reaches the worker unchanged (numbers stay integers); policyFile text
    replaces it verbatim."""
    docs = render("production-values.yaml")
    values = yaml.safe_load((CHART / "ci/production-values.yaml").read_text())
    assert yaml.safe_load(one(docs, "ConfigMap", "-policy")["data"]["policy.yaml"]) == values["policy"]
    docs = render("ephemeral-values.yaml")
    values = yaml.safe_load((CHART / "ci/ephemeral-values.yaml").read_text())
    assert one(docs, "ConfigMap", "-policy")["data"]["policy.yaml"] == values["policyFile"]


@pytest.mark.parametrize(("sets", "status", "message"), [
    ((), 0, "a valid policy"),
    (("policy.defaults.retry_budgte=3",), 2, "defaults.retry_budgte: unknown setting"),  # a typo
    (("policy.tools.send_email.side_effect=yes",), 2, "tools.send_email.side_effect: must be bool"),
])
def test_a_pre_upgrade_hook_checks_the_policy_before_any_worker_rolls(
        sets: tuple[str, ...], status: int, message: str, tmp_path: Path) -> None:
    """A pre-install/pre-upgrade hook Job runs `loopwarden policy check` on exactly the policy the
    workers would load (its own hook ConfigMap: pre-install hooks run before the release's resources
    exist). Run here as the Job runs it: a typo exits 2 with the setting's path, which fails `helm
    upgrade` before the StatefulSet is touched (it is no hook, so it is updated only after hooks pass)."""
    docs = render(DEFAULTS, *sets)
    job = one(docs, "Job", "-policy-check")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    hook_cm = one(docs, "ConfigMap", "-policy-check")
    assert "pre-install" in hook_cm["metadata"]["annotations"]["helm.sh/hook"]
    assert int(hook_cm["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert hook_cm["data"] == one(docs, "ConfigMap", "-policy")["data"]
    assert "helm.sh/hook" not in worker(docs)[0]["metadata"].get("annotations", {})
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:2] == ["policy", "check"] and job["spec"]["backoffLimit"] == 0
    checked = Path(container["args"][2])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(checked.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == hook_cm["metadata"]["name"]
    assert container["image"] == worker(docs)[1]["image"]
    (tmp_path / checked.name).write_text(hook_cm["data"][checked.name])
    result = subprocess.run([sys.executable, "-m", "stream_app", *container["args"][:2], str(tmp_path / checked.name)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_checksum_annotation_follows_the_policy() -> None:
    """checksum/config is the sha256 of the policy ConfigMap, so a policy change rolls the workers and
    nothing else does."""
    checksum = lambda docs: worker(docs)[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]  # noqa: E731
    assert re.fullmatch(r"[0-9a-f]{64}", checksum(render()))
    assert checksum(render(DEFAULTS, "replicaCount=5")) == checksum(render())
    assert checksum(render(DEFAULTS, "policy.defaults.retry_budget=5")) != checksum(render())


@pytest.mark.parametrize("values_file", ALL)
def test_metrics_port_agrees_everywhere(values_file: str) -> None:
    """LOOPWARDEN_METRICS_PORT is the container's "metrics" port, the port of both Services, the one the
    readiness check reads, and what the ServiceMonitor scrapes."""
    docs = render(values_file)
    _, container = worker(docs)
    port = int(env_of(container)["LOOPWARDEN_METRICS_PORT"])
    assert env_of(container)["LOOPWARDEN_METRICS_HOST"] == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"] == [port]
    for service in kinds(docs, "Service"):
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "metrics")]
    assert f"127.0.0.1:{port}/metrics" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    for monitor in kinds(docs, "ServiceMonitor"):
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


@pytest.mark.parametrize("values_file", ALL)
def test_security_context_is_restricted(values_file: str) -> None:
    """Non-root, no privilege escalation, all capabilities dropped, RuntimeDefault seccomp, read-only
    root filesystem; the only writable paths (state, /tmp) are volumes; no service account token."""
    sts, container = worker(render(values_file))
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsNonRoot"] is True
    assert security.get("privileged") is False
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {env_of(container)["LOOPWARDEN_STATE_DIR"], "/tmp"}


def test_state_is_a_persistent_volume_claim_per_worker() -> None:
    """With persistence (the default) the state directory is a volumeClaimTemplate; the StatefulSet is
    governed by a headless Service and its pods are spread over nodes."""
    docs = render("production-values.yaml")
    sts, container = worker(docs)
    state_dir = env_of(container)["LOOPWARDEN_STATE_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi" and claim["spec"]["storageClassName"] == "fast-ssd"
    assert mount["name"] not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    headless = one(docs, "Service", "-headless")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert sts["spec"]["replicas"] == 4


def test_state_falls_back_to_an_empty_dir() -> None:
    """persistence.enabled=false: no claims, the state directory is an emptyDir with its size limit."""
    sts, container = worker(render("ephemeral-values.yaml"))
    assert "volumeClaimTemplates" not in sts["spec"]
    state_dir = env_of(container)["LOOPWARDEN_STATE_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"] == {"sizeLimit": "2Gi"}


def test_values_reach_the_worker_settings() -> None:
    """Topic names, partition counts, standby replicas and the Kafka bootstrap servers are values."""
    docs = render(DEFAULTS, "worker.standbyReplicas=2", "topics.partitions=16", "topics.telemetry=fleet.calls",
                  "kafka.bootstrapServers=b1:9092\\,b2:9092")
    settings = WorkerSettings.from_env(env_of(worker(docs)[1]))
    assert (settings.standby_replicas, settings.partitions, settings.telemetry_topic) == (2, 16, "fleet.calls")
    assert settings.kafka.bootstrap_servers == "b1:9092,b2:9092"


def test_sasl_and_tls_come_from_secrets() -> None:
    """SASL_SSL: mechanism as a value, user name and password from the named Secret, the CA bundle a
    file in the mounted TLS Secret."""
    sts, container = worker(render("production-values.yaml"))
    env = env_of(container)
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["KAFKA_SASL_USERNAME"] == {"secretKeyRef": {"name": "loopwarden-kafka-user", "key": "username"}}
    assert env["KAFKA_SASL_PASSWORD"] == {"secretKeyRef": {"name": "loopwarden-kafka-user", "key": "password"}}
    (mount,) = [m for m in container["volumeMounts"] if env["KAFKA_SSL_CAFILE"].startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "kafka-cluster-ca" and mount["readOnly"] is True
    assert env["KAFKA_SSL_CAFILE"].endswith("/ca.crt")
    assert "KAFKA_SSL_CERTFILE" not in env


def test_mutual_tls_mounts_the_client_certificate() -> None:
    """SSL with a client certificate: CA, certificate and key are files of the one mounted Secret."""
    _, container = worker(render("mtls-values.yaml"))
    env = env_of(container)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kafka-tls"]
    for var, key in (("KAFKA_SSL_CAFILE", "ca.crt"), ("KAFKA_SSL_CERTFILE", "tls.crt"), ("KAFKA_SSL_KEYFILE", "tls.key")):
        assert env[var] == f"{mount['mountPath']}/{key}"
    assert not any(name.startswith("KAFKA_SASL") for name in env)


@pytest.mark.parametrize(("sets", "message"), [
    (["kafka.securityProtocol=SASL_SSL", "kafka.sasl.existingSecret=s"], "kafka.sasl.mechanism: required"),
    (["kafka.securityProtocol=SASL_PLAINTEXT", "kafka.sasl.mechanism=PLAIN"], "kafka.sasl.existingSecret: required"),
    (["kafka.sasl.mechanism=PLAIN"], "use SASL_PLAINTEXT or SASL_SSL"),
    (["kafka.tls.existingSecret=ca"], "use SSL or SASL_SSL"),
    (["worker.heartbeatSeconds=5"], "at most a third"),
    (["signing.allowUnsigned=true"], "but signing.existingSecret is set"),  # a key and no key
    (["kafka.securityProtocol=TLS"], "securityProtocol"),                   # schema: enum
    (["topics.partitions=0"], "partitions"),                                # schema: minimum
    (["operators.maxAgeSeconds=0"], "maxAgeSeconds"),                       # schema: minimum
    (["signing.allowUnsigned=yes"], "allowUnsigned"),                       # schema: type
    (["signing.keyKey=keys/worker.key"], "keyKey"),                         # schema: pattern (a Secret key)
    (["replicas=3"], "replicas"),                                           # schema: unknown value
    (["signing.secret=s"], "secret"),                                       # schema: unknown value
])
def test_settings_that_cannot_work_fail_the_render(sets: list[str], message: str) -> None:
    """What the worker would refuse at start-up, the chart refuses at install, naming the value."""
    args = [a for item in sets for a in ("--set", item)]
    assert message in render_fails("--values", str(CHART / "ci" / DEFAULTS), *args)


# --------------------------------------------------------------------------------------------------
# Signing key and operator keys


@pytest.mark.parametrize("values_file", ALL)
def test_signing_key_is_mounted_from_its_secret(values_file: str) -> None:
    """LOOPWARDEN_SIGNING_KEY is a file in a read-only mount of signing.existingSecret holding only
    signing.keyKey, owner-read (0400); the workers publish nothing unsigned."""
    signing = scenario(values_file)["signing"]
    sts, container = worker(render(values_file))
    env = env_of(container)
    key_path = Path(env["LOOPWARDEN_SIGNING_KEY"])
    assert "LOOPWARDEN_ALLOW_UNSIGNED" not in env
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(key_path.parent)]
    assert mount["readOnly"] is True
    secret = volume_of(sts, mount)["secret"]
    assert secret["secretName"] == signing["existingSecret"]
    key = signing.get("keyKey", "signing.key")
    assert secret["items"] == [{"key": key, "path": key_path.name}] and key_path.name == key
    assert secret["defaultMode"] == 0o400


@pytest.mark.parametrize("args", [
    [],                                                                    # the bare chart
    ["--values", str(CHART / "ci" / DEFAULTS), "--set", "signing.existingSecret="],  # emptied
])
def test_rendering_without_a_signing_key_fails(args: list[str]) -> None:
    """No signing secret and no signing.allowUnsigned: the render (helm install, helm template) fails,
    saying what to create and where to put it. (helm lint only logs a missing `required` value.)"""
    message = "signing.existingSecret: required, a Secret with the workers' Ed25519 signing key"
    assert message in render_fails(*args)


def test_allow_unsigned_renders_no_key() -> None:
    """signing.allowUnsigned=true (development): LOOPWARDEN_ALLOW_UNSIGNED=true, no signing key
    variable, no Secret mounted; the worker accepts that environment."""
    sts, container = worker(render(None, "signing.allowUnsigned=true"))
    env = env_of(container)
    assert env["LOOPWARDEN_ALLOW_UNSIGNED"] == "true" and "LOOPWARDEN_SIGNING_KEY" not in env
    assert [v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v] == []
    assert {m["name"] for m in container["volumeMounts"]} == {"state", "policy", "tmp"}
    WorkerSettings.from_env(env)


def test_operator_keys_are_mounted_when_configured() -> None:
    """operators.existingConfigMap: LOOPWARDEN_OPERATOR_KEYS is a read-only mount of that ConfigMap
    (the worker reads every *.pub in it), with LOOPWARDEN_OPERATOR_MAX_AGE_S; without one, neither is
    set and operator commands are refused."""
    operators = scenario("production-values.yaml")["operators"]
    sts, container = worker(render("production-values.yaml"))
    env = env_of(container)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["LOOPWARDEN_OPERATOR_KEYS"]]
    assert mount["readOnly"] is True
    assert volume_of(sts, mount)["configMap"] == {"name": operators["existingConfigMap"]}
    assert env["LOOPWARDEN_OPERATOR_MAX_AGE_S"] == str(operators["maxAgeSeconds"])
    _, container = worker(render())
    assert not {"LOOPWARDEN_OPERATOR_KEYS", "LOOPWARDEN_OPERATOR_MAX_AGE_S"} & set(env_of(container))


def test_resources_probes_and_disruption_budget() -> None:
    """Requests and limits, startup/liveness/readiness probes, and a PodDisruptionBudget selecting the
    workers."""
    docs = render()
    sts, container = worker(docs)
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(container)
    assert "loopwarden_worker_ready 1.0" in " ".join(container["readinessProbe"]["exec"]["command"])
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert kinds(render("ephemeral-values.yaml"), "PodDisruptionBudget") == []


# --------------------------------------------------------------------------------------------------
# Monitoring resources


def test_prometheus_rule_is_the_shared_rules_file() -> None:
    """The PrometheusRule's groups are exactly those of files/loopwarden-rules.yml, the file compose
    mounts into Prometheus, and it carries the labels the operator selects rules by."""
    rule = one(render("production-values.yaml"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert kinds(render(), "PrometheusRule") == []


def test_service_monitor_scrapes_the_metrics_service_as_job_loopwarden() -> None:
    """The ServiceMonitor selects the metrics Service (which also lists workers not ready yet) and
    relabels the job to "loopwarden", the job the alert rules select."""
    docs = render("production-values.yaml")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", "-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["agents"]}
    assert service["spec"]["publishNotReadyAddresses"] is True
    (endpoint,) = monitor["spec"]["endpoints"]
    assert {"action": "replace", "targetLabel": "job", "replacement": "loopwarden"} in endpoint["relabelings"]
    assert 'job="loopwarden"' in RULES.read_text()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_grafana_dashboard_configmap() -> None:
    """The dashboard ships as a ConfigMap labelled for the Grafana sidecar (grafana_dashboard: "1"),
    holding files/dashboards/loopwarden.json."""
    configmap = one(render("production-values.yaml"), "ConfigMap", "-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Agents"}
    assert json.loads(configmap["data"]["loopwarden.json"]) == json.loads(DASHBOARD.read_text())
    # Without dashboards.enabled: only the policy's ConfigMaps (the workers' and the check hook's).
    assert kinds(render(), "ConfigMap") == [one(render(), "ConfigMap", "-policy"),
                                            one(render(), "ConfigMap", "-policy-check")]


def test_dashboard_queries_use_worker_metrics() -> None:
    """Every dashboard panel queries series a worker exports, with the job the rules use."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "loopwarden" and dashboard["panels"]
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert metric_names(target["expr"]) <= worker_series(), (panel["title"], target["expr"])
            assert 'job="loopwarden"' in target["expr"]


# --------------------------------------------------------------------------------------------------
# values.yaml documentation and schema


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for key, value in node.items() for p in _leaf_paths(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_every_value_has_a_comment() -> None:
    """Every value (or the object it belongs to) has a `## @param` line, and every @param names a
    value that exists."""
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*## @param (\S+) \S", text, re.MULTILINE))
    values = yaml.safe_load(text)
    for path in _leaf_paths(values):
        parts = path.split(".")
        assert any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)), path
    for path in documented:
        node: Any = values
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"@param {path} names no value"
            node = node[part]


def test_schema_covers_every_top_level_value() -> None:
    """values.schema.json describes every top-level value and refuses unknown ones."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(values)


def test_rules_file_is_inside_the_chart_and_nowhere_else() -> None:
    """One rules file, no copies or symlinks: the chart embeds it and compose mounts it from there."""
    assert not RULES.is_symlink()
    digest = hashlib.sha256(RULES.read_bytes()).hexdigest()
    copies = [p for p in REPO.rglob("*.yml") if ".cache" not in p.parts and ".venv" not in p.parts
              and p != RULES and hashlib.sha256(p.read_bytes()).hexdigest() == digest]
    assert copies == []
