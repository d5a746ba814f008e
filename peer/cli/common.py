"""What every `pathswarm` subcommand shares: logging, signals, the swarm flags, the handler type."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable

logger = logging.getLogger("pathswarm")

Handler = Callable[[argparse.Namespace], int]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    # hivemind configures its own loggers; keep its chatter at warnings.
    logging.getLogger("hivemind").setLevel(logging.WARNING if level != "DEBUG" else logging.DEBUG)


def install_sigterm(stop: Callable[[], None]) -> None:
    """SIGTERM (docker stop) and Ctrl-C call `stop`: the peer finishes its step, checkpoints, leaves."""

    def handler(signum, frame):
        logger.info(f"received signal {signum}: finishing the current step, then leaving")
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def add_swarm_flags(p: argparse.ArgumentParser) -> None:
    """hivemind/petals' flags for joining a swarm; absent flags stay absent (config files fill them)."""
    s = argparse.SUPPRESS
    p.add_argument("--initial_peers", nargs="*", default=s, help="multiaddrs of peers already in the swarm")
    p.add_argument("--host_maddrs", nargs="*", default=s, help="multiaddrs to listen on")
    p.add_argument("--announce_maddrs", nargs="*", default=s, help="multiaddrs to advertise to other peers")
    p.add_argument(
        "--identity_path", default=s, help="file with this peer's private key (created if missing)"
    )
    p.add_argument("--use_relay", action="store_true", default=s, help="use libp2p circuit relays (default)")
    p.add_argument(
        "--no_relay",
        dest="use_relay",
        action="store_false",
        default=s,
        help="hivemind's use_relay=False (its p2pd still relays for others: measured)",
    )
    p.add_argument(
        "--use_auto_relay",
        action="store_true",
        default=s,
        help="behind NAT: reserve a slot on the initial peers (the relays) and be reached through them",
    )
