"""The ``loopwarden`` command: ``replay``, ``explain``, ``simulate``, ``worker``, ``notify``, ``demo``, ``halt``,
``resume``, ``policy check`` and ``keys``."""

from __future__ import annotations

import argparse
import os
import sys

from .bus.policy_file import load_policy
from .core import LoopwardenError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopwarden",
        description="Tell an AI agent's legitimate retry from runaway recursion, and stop the runaway.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    replay = commands.add_parser(
        "replay",
        help="run the detector over a telemetry JSONL file (no Kafka); decisions as JSONL on stdout",
    )
    replay.add_argument("file", help="telemetry JSONL file, or - for stdin")
    replay.add_argument("--policy", metavar="FILE", help="policy YAML (defaults apply without it)")
    replay.add_argument("--engine", choices=("auto", "native", "python"), default="auto",
                        help="native: the Rust engine (several times faster, same output); python: the reference "
                             "core; auto (default): native when installed")
    explain = commands.add_parser(
        "explain",
        help="the story of a halt for on-call: why, the failure, the streak's events and what changed in the "
             "arguments; from the alerts topic, or from a telemetry file",
    )
    explain.add_argument("id", metavar="DECISION_OR_RUN_ID", help="a decision id, or a run id (all its decisions)")
    explain.add_argument("--telemetry", metavar="FILE",
                         help="replay this telemetry JSONL file instead of reading the alerts topic (shows every "
                              "decision, warnings too, and the calls)")
    explain.add_argument("--policy", metavar="FILE", help="policy YAML for --telemetry (defaults apply without it)")
    explain.add_argument("--engine", choices=("auto", "native", "python"), default="auto",
                         help="engine for --telemetry (as replay's)")
    explain.add_argument("--json", action="store_true", help="print the matching decisions as control v1 JSONL")
    commands.add_parser(
        "worker",
        help="run a fleet worker (Faust on Kafka); configured by environment variables, see README",
    )
    notify = commands.add_parser(
        "notify",
        help="post each halt on the alerts topic to a webhook (CloudEvents JSON or Slack); configured by "
             "environment variables, see README",
    )
    notify.add_argument("--url", help="webhook URL (default: $LOOPWARDEN_NOTIFY_URL)")
    notify.add_argument("--format", choices=("json", "slack"),
                        help="json: a CloudEvent; slack: an incoming-webhook message (default: $LOOPWARDEN_NOTIFY_FORMAT or json)")
    demo = commands.add_parser(
        "demo", help="a simulated fleet guarded through the SDK and a real worker; prints what was halted"
    )
    demo.add_argument("--runs", type=count, default=60, help="concurrent agent runs (default 60)")
    demo.add_argument("--partitions", type=int, default=4, help="telemetry partitions (default 4)")
    demo.add_argument("--seed", type=int, default=7, help="random seed of the fleet")
    for action, text in (("halt", "halt a run now"), ("resume", "lift a halt; the run starts with fresh streaks")):
        override = commands.add_parser(
            action, help=f"operator override: {text} (signed with your operator key, recorded on the alerts topic)"
        )
        override.add_argument("run_id", nargs="?", help="the run to act on")
        override.add_argument("--tree", metavar="ROOT", help="act on the sub-agent tree of this root run id instead")
        override.add_argument("--thread", metavar="TENANT/THREAD",
                              help="act on a thread instead (`/THREAD` for telemetry that names no tenant; a `/` "
                                   "in the tenant as %%2F, a `%%` as %%25)")
        override.add_argument("--tool", metavar="TENANT/TOOL/UPSTREAM",
                              help="pause (halt) or resume a tool of an upstream for a tenant instead (`/` in the "
                                   "tenant or the tool as %%2F, `%%` as %%25)")
        override.add_argument("--reason", required=True, help="why (recorded with the decision)")
        override.add_argument("--operator", help="who (default: $LOOPWARDEN_OPERATOR, else the login name)")
        override.add_argument("--key", help="operator's Ed25519 private key, PEM (default: $LOOPWARDEN_OPERATOR_KEY)")
        override.add_argument("--wait", action=argparse.BooleanOptionalAction, default=None,
                              help="watch the control topic for the workers' decision and the DLQ for a refusal "
                                   "(default: on when stdout is a terminal); exit 0 applied, 3 refused, 4 not "
                                   "confirmed in time")
        override.add_argument("--timeout", type=float, default=10.0, help="seconds --wait waits (default 10)")
    policy = commands.add_parser("policy", help="check a policy file: exit 0 if workers and runtimes can load it")
    policy.add_argument("action", choices=("check",))
    policy.add_argument("file", help="policy YAML")
    keys = commands.add_parser("keys", help="generate an Ed25519 key pair (worker signing key or operator key)")
    keys.add_argument("action", choices=("generate",))
    keys.add_argument("--out", default=".", help="directory for NAME.key (private, mode 0600) and NAME.pub")
    keys.add_argument("--name", default="loopwarden", help="file name stem (default: loopwarden)")
    simulate = commands.add_parser(
        "simulate", help="write the telemetry of a simulated mixed fleet as JSONL (input for replay)"
    )
    simulate.add_argument("--runs", type=count, default=100, help="number of agent runs (default 100)")
    simulate.add_argument("--seed", type=int, default=7, help="random seed; same seed, same file")
    return parser


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run one command; an error a person must fix (a setting, a policy file, an unreachable broker, a
    refused login) is one line on stderr naming what to check, exit status 2, never a traceback."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except LoopwardenError as exc:
        _fail(args.command, str(exc))
    except BrokenPipeError:
        # the reader went away (``simulate | head``): no traceback, and none at exit's flush either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a file named on the command line that cannot be read or written
        _fail(args.command, f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    return 2


def _fail(command: str, message: str) -> None:
    """One line on stderr; for the processes that run on the bus, in their log format."""
    from .bus import logs

    fmt = os.environ.get("LOOPWARDEN_LOG_FORMAT", "json").strip() if command in ("worker", "notify") else "text"
    logs.fatal(command, message, fmt if fmt in logs.FORMATS else "text")


def _run(args: argparse.Namespace) -> int:
    if args.command == "simulate":
        import orjson

        from .devtools.fleet_sim import simulate_fleet

        _, stream = simulate_fleet(args.runs, seed=args.seed)
        sys.stdout.buffer.writelines(orjson.dumps(event) + b"\n" for event in stream)
        return 0
    if args.command == "demo":
        from .devtools.demo import main as demo_main

        return demo_main(os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), args.runs, args.partitions, args.seed)
    if args.command == "worker":
        from .worker.main import run_worker
        from .worker.settings import WorkerSettings

        return run_worker(WorkerSettings.from_env())
    if args.command in ("halt", "resume"):
        from .commands.operator import run_operator_command

        wait = sys.stdout.isatty() if args.wait is None else args.wait
        targets = [(scope, value) for scope, value in (("run", args.run_id), ("tree", args.tree),
                                                        ("thread", args.thread), ("tool", args.tool))
                   if value is not None]
        if len(targets) != 1:
            _parser().error(f"{args.command}: name exactly one of RUN_ID, --tree, --thread, --tool")
        scope, target = targets[0]
        return run_operator_command(args.command, target, args.reason, args.operator, args.key,
                                    wait=wait, timeout_s=args.timeout, scope=scope)
    if args.command == "keys":
        from .bus.signing import generate

        private, public, kid = generate(args.out, args.name)
        print(f"{kid}\n  private: {private}\n  public:  {public}")
        return 0
    if args.command == "notify":
        from .commands.notify import NotifySettings, run_notify

        return run_notify(NotifySettings.from_env(url=args.url, format=args.format))
    if args.command == "policy":
        policy = load_policy(args.file)
        print(f"{args.file}: a valid policy (digest {policy.digest})")
        return 0
    if args.command == "explain":
        from .commands.explain import run_explain

        return run_explain(args.id, args.telemetry, load_policy(args.policy), args.engine, args.json)
    if args.command == "replay":
        from .commands.replay import run_replay

        return run_replay(args.file, load_policy(args.policy), args.engine)
    raise AssertionError(f"unhandled command {args.command}")
