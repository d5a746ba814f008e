"""The `pathswarm` command line: peer, bootstrap, run (create, invite, admit, reroute), demo, eval,
generate, export, schedule, health, monitor (`--help` lists them from the parser).

Every subcommand is thin: parse, build, run, shut down in `finally`. A `PathswarmError` (a mistake the
person running the command can fix) or an OS error is one line on stderr and exit status 2; anything
else is a bug and keeps its traceback. SIGTERM and Ctrl-C let a peer finish its step and checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from peer.cli import demo, health, model_commands, monitor_command, run_commands, schedule, swarm_commands
from peer.cli.common import Handler
from peer.cli.flags import HelpParser
from peer.errors import PathswarmError


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    parser = HelpParser(prog="pathswarm")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Handler] = {}
    for module in (swarm_commands, run_commands, demo, model_commands, schedule, health, monitor_command):
        commands.update(module.register(sub))
    # named from the parser itself, so that a new subcommand cannot be missing from it
    parser.description = f"The `pathswarm` command line: {', '.join(subcommand_names(parser))}."
    return parser, commands


def subcommand_names(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """Every subcommand, nested ones as "run create"."""
    names = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                nested = subcommand_names(child, f"{prefix}{name} ")
                names.extend(nested or [f"{prefix}{name}"])
    return names


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        return commands[args.command](args)
    except TimeoutError:
        raise  # an OSError by class, but a bug or a hang of ours, not the user's input: keep its traceback
    except (PathswarmError, OSError) as e:
        text = str(e).splitlines()[0] if str(e) else repr(e)
        print(f"pathswarm {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
