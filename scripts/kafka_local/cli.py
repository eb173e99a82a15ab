"""The command line, ``python -m scripts.kafka_local COMMAND``: resolve, start [--secure], stop, status,
create-topics, acls and exec.

Kept apart from the library so that what the tests import has no argparse in it, and what a shell
sees is in one place: ``start`` prints ``KAFKA_BOOTSTRAP_SERVERS=host:port`` (and, secured, the other
KAFKA_* variables) for ``export $(...)``, diagnostics go to stderr, failures exit 1 with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from . import __doc__ as package_doc
from .admin import TopicSpec, create_topics
from .broker import (
    LocalKafka,
    default_state_file,
    free_port,
    read_state,
    state_login,
    stop_state,
    write_state,
)
from .errors import KafkaLocalError
from .jars import DEFAULT_VERSION, cache_dir, resolve
from .security import (
    ADMIN_USER,
    BrokerSecurity,
    LoopwardenAcls,
    TlsFiles,
    acl_command_line,
    add_acls,
    make_tls_files,
    write_private,
)

PROG = "python -m scripts.kafka_local"


def _cli_security(args: argparse.Namespace, data_dir: Path) -> BrokerSecurity | None:
    """``start --secure``: the TLS files and the admin password are made at a data dir's first start and
    reused after, with its users (their SCRAM credentials are fixed when the storage is formatted) and,
    unless given again, its ``--client-auth``."""
    users = dict(item.split("=", 1) for item in args.user)
    if not args.secure:
        if users or args.client_auth:
            raise KafkaLocalError("--user and --client-auth need --secure")
        return None
    saved_path = data_dir / "secure.json"
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        if users and users != saved["users"]:
            raise KafkaLocalError(
                f"{data_dir} was formatted with users {sorted(saved['users'])}: SCRAM users are fixed at the "
                "first start of a data dir; start without --user, or use a new --data-dir"
            )
        users, admin_password = saved["users"], saved["admin_password"]
        client_auth = args.client_auth or saved["client_auth"]
    elif (data_dir / "kraft-logs" / "meta.properties").exists():
        raise KafkaLocalError(f"{data_dir} was formatted without --secure: use a new --data-dir")
    else:
        admin_password, client_auth = secrets.token_urlsafe(18), args.client_auth or "none"
    tls_dir = data_dir / "tls"
    tls = TlsFiles.in_directory(tls_dir) if (tls_dir / "ca.pem").exists() else make_tls_files(tls_dir)
    security = BrokerSecurity(tls, users, admin_password, client_auth=client_auth)
    saved = {"users": users, "admin_password": admin_password, "client_auth": client_auth}
    write_private(saved_path, json.dumps(saved) + "\n")
    return security


def _cmd_start(args: argparse.Namespace) -> int:
    state_file: Path = args.state_file
    running = read_state(state_file)
    if running is not None:
        raise KafkaLocalError(
            f"a broker from {state_file} already runs at {running['bootstrap']}: stop it first"
        )
    port: int | None = args.port
    data_dir: Path | None = args.data_dir
    if data_dir is None:
        port = port or free_port()
        data_dir = cache_dir() / f"broker-{port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    extra = dict(item.split("=", 1) for item in args.property)
    security = _cli_security(args, data_dir)
    broker = LocalKafka(
        data_dir=data_dir, port=port, version=args.kafka_version, extra_properties=extra, security=security
    )
    broker.start()
    env = {"KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap}
    if security is not None:
        env.update(KAFKA_SECURITY_PROTOCOL="SASL_SSL", KAFKA_SSL_CAFILE=str(security.tls.ca))
        if security.client_auth != "none":
            env.update(KAFKA_SSL_CERTFILE=str(security.tls.client_cert),
                       KAFKA_SSL_KEYFILE=str(security.tls.client_key))
        print(
            f"kafka_local: SASL_SSL (SCRAM-SHA-512 or PLAIN) for {', '.join(sorted(security.users)) or 'no users'}"
            f"{', ACLs on' if security.acls else ''}; Kafka's tools as {ADMIN_USER}: "
            f"--command-config {broker.admin_properties_path}",
            file=sys.stderr,
        )
    write_state(state_file, broker)
    for name, value in env.items():
        print(f"{name}={value}")
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    state = read_state(args.state_file)
    if state is None:
        print("kafka_local: no broker running", file=sys.stderr)
    else:
        stop_state(state)
        print(f"kafka_local: stopped the broker at {state['bootstrap']}", file=sys.stderr)
    args.state_file.unlink(missing_ok=True)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state = read_state(args.state_file)
    if state is None:
        print("not running")
        return 1
    print(f"running: pid {state['pid']}, KAFKA_BOOTSTRAP_SERVERS={state['bootstrap']}, log {state['log']}")
    return 0


def _cmd_resolve(args: argparse.Namespace) -> int:
    print(resolve(args.kafka_version))
    return 0


def _cmd_create_topics(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        state = read_state(args.state_file)
        if state is None:
            raise KafkaLocalError("no --bootstrap, no KAFKA_BOOTSTRAP_SERVERS and no running broker")
        bootstrap = str(state["bootstrap"])
    state = read_state(args.state_file)
    login = state_login(state) if state is not None and state["bootstrap"] == bootstrap else None
    create_topics(bootstrap, [TopicSpec.parse(text) for text in args.topics], login=login)
    return 0


def _cmd_acls(args: argparse.Namespace) -> int:
    """Print loopwarden's ACLs as kafka-acls commands, or add them to the secured broker the CLI started
    (creating loopwarden's topics first with ``--create-topics``)."""
    acls = LoopwardenAcls(
        worker=args.worker, runtimes=args.runtime, notify=args.notify, operators=args.operator,
        app_id=args.app_id, telemetry_topic=args.telemetry_topic, control_topic=args.control_topic,
        alerts_topic=args.alerts_topic, dlq_topic=args.dlq_topic, notify_group=args.notify_group,
        facts_topic=args.facts_topic, scopes_topic=args.scopes_topic,
    )
    if args.print:
        print("\n".join(acl_command_line(command) for command in acls.commands()))
        return 0
    state = read_state(args.state_file)
    if state is None or "admin_properties" not in state:
        raise KafkaLocalError("no secured broker running: start one with `start --secure`, or use --print")
    bootstrap = str(state["bootstrap"])
    if args.create_topics:
        create_topics(bootstrap, acls.topic_specs(args.create_topics), login=state_login(state))
    add_acls(bootstrap, Path(str(state["admin_properties"])), acls.commands(), str(state["version"]))
    print(f"kafka_local: loopwarden's ACLs added on {bootstrap}", file=sys.stderr)
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    """Run a command with KAFKA_BOOTSTRAP_SERVERS set: the caller's broker if it is already set, else a
    broker started for the command and stopped after it, also on Ctrl-C."""
    command = [part for part in args.cmd if part != "--"]
    if not command:
        raise KafkaLocalError("exec needs a command after --")
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return subprocess.call(command)
    with LocalKafka(version=args.kafka_version) as broker:
        print(f"kafka_local: starting Apache Kafka {broker.version} ...", file=sys.stderr, flush=True)
        broker.start()
        print(f"kafka_local: broker ready at {broker.bootstrap}", file=sys.stderr, flush=True)
        child = subprocess.Popen(command, env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap})
        try:
            return child.wait()
        except KeyboardInterrupt:
            # The terminal sent SIGINT to the whole process group: give the command time to clean up.
            try:
                return child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=package_doc.split("\n\n")[0] if package_doc else None)
    commands = parser.add_subparsers(dest="command", required=True)

    def with_state_file(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument(
            "--state-file", type=Path, default=default_state_file(), help="default: %(default)s"
        )
        return sub

    start = with_state_file(commands.add_parser("start", help="start a broker in the background"))
    start.add_argument("--data-dir", type=Path, help="default: <cache>/broker-<port>; reused if it exists")
    start.add_argument(
        "--port", type=int, help="broker port (default: the data dir's previous one, or a free one)"
    )
    start.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    start.add_argument(
        "--property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra server property (repeatable)",
    )
    start.add_argument(
        "--secure",
        action="store_true",
        help="SASL_SSL listener (SCRAM-SHA-512 and PLAIN), ACLs on, TLS files made in <data-dir>/tls",
    )
    start.add_argument(
        "--user", action="append", default=[], metavar="NAME=PASSWORD", help="with --secure: a user (repeatable)"
    )
    start.add_argument(
        "--client-auth", choices=("none", "requested", "required"), help="with --secure: ssl.client.auth (default none)"
    )
    start.set_defaults(run=_cmd_start)
    with_state_file(commands.add_parser("stop", help="stop the broker started by `start`")).set_defaults(
        run=_cmd_stop
    )
    with_state_file(commands.add_parser("status", help="exit 0 if the broker runs")).set_defaults(
        run=_cmd_status
    )
    res = commands.add_parser("resolve", help="only fetch the jars (CI warm-up)")
    res.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    res.set_defaults(run=_cmd_resolve)
    topics = with_state_file(
        commands.add_parser("create-topics", help="create topics; existing ones are fine")
    )
    topics.add_argument("--bootstrap", help="default: $KAFKA_BOOTSTRAP_SERVERS, else the running broker")
    topics.add_argument("topics", nargs="+", metavar="TOPIC:PARTITIONS[:compact]")
    topics.set_defaults(run=_cmd_create_topics)
    acls = with_state_file(
        commands.add_parser("acls", help="loopwarden's ACLs: add them to the secured broker, or --print them")
    )
    acls.add_argument("--print", action="store_true", help="only print them as kafka-acls.sh commands")
    acls.add_argument("--create-topics", type=int, metavar="PARTITIONS", help="first create loopwarden's topics")
    acls.add_argument("--worker", required=True, metavar="USER", help="the workers' user")
    for flag, dest in (("--runtime", "runtime"), ("--notify", "notify"), ("--operator", "operator")):
        acls.add_argument(flag, dest=dest, action="append", default=[], metavar="USER", help="repeatable")
    for flag, default in (
        ("--app-id", "loopwarden"),
        ("--telemetry-topic", "agent.telemetry"),
        ("--control-topic", "agent.control"),
        ("--alerts-topic", "agent.alerts"),
        ("--dlq-topic", "agent.telemetry.dlq"),
        ("--notify-group", "loopwarden-notify"),
        ("--facts-topic", "loopwarden.facts"),
        ("--scopes-topic", "loopwarden.scopes"),
    ):
        acls.add_argument(flag, default=default, help="default: %(default)s")
    acls.set_defaults(run=_cmd_acls)
    run_with = commands.add_parser("exec", help="run a command against a broker (started if none is set)")
    run_with.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    run_with.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    run_with.set_defaults(run=_cmd_exec)

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (KafkaLocalError, ValueError) as exc:
        print(f"kafka_local: error: {exc}", file=sys.stderr)
        return 1
