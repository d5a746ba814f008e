"""The `pathswarm` command line: peer, bootstrap, run create, run reroute, demo, eval, generate,
export, schedule, health, monitor.

Every subcommand is thin: parse, build, run, shut down in `finally`. A `PathswarmError` (a mistake the
person running the command can fix) or an OS error is one line on stderr and exit status 2; anything
else is a bug and keeps its traceback. SIGTERM and Ctrl-C let a peer finish its step and checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from peer.cli import demo, health, model_commands, monitor_command, run_commands, schedule, swarm_commands
from peer.cli.common import Handler
from peer.errors import PathswarmError


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    # the docstring's first paragraph, whole: it names every subcommand
    parser = argparse.ArgumentParser(prog="pathswarm", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Handler] = {}
    for module in (swarm_commands, run_commands, demo, model_commands, schedule, health, monitor_command):
        commands.update(module.register(sub))
    return parser, commands


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
