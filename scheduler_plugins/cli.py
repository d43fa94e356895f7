"""``tessera``: the one command-line entry point; subcommands stay thin."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from api.errors import InvalidInputError, TesseraError
from api.hami.config import DeviceConfig, convert_known_geometries, load_config_file


def _cmd_simulate(args: argparse.Namespace) -> int:
    from scheduler_plugins.simulate import render_table, simulate

    config = load_config_file(args.config) if args.config else DeviceConfig()
    simulation = simulate(  # validates everything
        Path(args.cluster), Path(args.pods), config, host_only_pods=args.host_only_pods
    )
    for s in simulation.skipped:
        print(f"tessera: warning: {s}", file=sys.stderr)
    results = list(simulation)
    if args.output == "json":
        for r in results:
            print(r.to_json())
    else:
        print(render_table(results, simulation.skipped))
    return 0


def _cmd_config_convert(args: argparse.Namespace) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as e:
        raise InvalidInputError(f"{args.file}: cannot read: {e.strerror}") from e
    out = convert_known_geometries(text)
    if args.output:
        Path(args.output).write_text(out)
    else:
        sys.stdout.write(out)
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    load_config_file(args.file)
    print(f"{args.file}: ok")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate", help="where would these pods go, and if not, why (and whom they would preempt)"
    )
    sim.add_argument("--cluster", required=True, help="Nodes and existing Pods (YAML)")
    sim.add_argument("--pods", required=True, help="Pods to place, in order (YAML)")
    sim.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    sim.add_argument("--output", choices=("json", "table"), default="table")
    sim.add_argument(
        "--host-only-pods",
        action="store_true",
        help="pods without a GPU request that name no scheduler are Tessera's too (the "
        "webhook's option); under the fragmentation policy Tessera places them",
    )
    sim.set_defaults(func=_cmd_simulate)

    cfg = sub.add_parser("config", help="device-config.yaml tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    conv = cfg_sub.add_parser("convert", help="knownMigGeometries -> migProfileAllowlist")
    conv.add_argument("file")
    conv.add_argument("-o", "--output", help="write here instead of stdout")
    conv.set_defaults(func=_cmd_config_convert)
    check = cfg_sub.add_parser("check", help="validate a device-config.yaml")
    check.add_argument("file")
    check.set_defaults(func=_cmd_config_check)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from node_agent.cli import add_node_agent_commands
    from scheduler_plugins.devtools.bench.cli import add_bench_command
    from scheduler_plugins.devtools.check import add_check_command
    from scheduler_plugins.devtools.cluster.cli import add_cluster_commands
    from scheduler_plugins.devtools.cluster.demo import add_demo_command
    from scheduler_plugins.devtools.cluster.local import add_local_commands
    from scheduler_plugins.logs import add_logging_flags
    from scheduler_plugins.server.cli import add_plugin_server_commands
    from scheduler_plugins.webhook.cli import add_webhook_commands

    add_cluster_commands(sub)
    add_demo_command(sub)
    add_local_commands(sub)
    add_node_agent_commands(sub, logging_flags=add_logging_flags)
    add_plugin_server_commands(sub)
    add_check_command(sub)
    add_webhook_commands(sub)
    add_bench_command(sub)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "log_format", None) is not None:  # a long-running command
            from scheduler_plugins.logs import configure_from_args

            configure_from_args(args)
        return int(args.func(args))
    except InvalidInputError as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 2
    except TesseraError as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
