"""Starting a hivemind DHT node for pathswarm: identity, validators, and clear errors.

One RSA key serves both as the libp2p identity (`--identity_path`, the file format hivemind's p2pd
reads) and as the key that signs this peer's DHT records (`dht.identity`), so a restarted peer with
the same identity still owns its claims and nobody else can speak for its peer id.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from dht.errors import SwarmError
from dht.identity import forget_ephemeral_identity, load_identity
from dht.keys import MAX_RECORD_TTL_SECONDS
from dht.shard_store import Admitted
from dht.startup_errors import explain_start_failure
from dht.validators import RecordSchemaValidator, RememberedValidation

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]


def _static_relays_only(make_process_args):
    """p2pd flags with `-relayDiscovery=0` whenever trusted relays are named.

    With discovery on (p2pd's default, and hivemind 1.1.12 cannot turn it off: its
    `use_relay_discovery` is ignored), go-libp2p's autorelay waits for 4 relay candidates or for
    its 3-minute boot delay before it reserves a slot anywhere; a volunteer who names its relays
    (the initial peers) would sit unreachable for those minutes. Static relays reserve at once.
    """

    def make(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_process_args(*args, **kwargs)

    make.pathswarm_static_relays = True
    return make


if not getattr(P2P._make_process_args, "pathswarm_static_relays", False):
    P2P._make_process_args = staticmethod(_static_relays_only(P2P._make_process_args))


def _whole_requests(run):
    """hivemind's DHT process, reading its requests from a blocking pipe.

    The DHT child watches its end of the request pipe with uvloop's `add_reader`, which makes the
    socket non-blocking. A request larger than the socket's buffer (a manifest record with its router
    and data shards, a big store) arrives in parts: the child reads the header, finds the rest not
    there yet, fails with EAGAIN, and has lost the framing; its next read dies with "Ran out of
    input" and the peer's DHT is gone. Measured: a 3 MiB store kills it every time on hivemind
    1.1.12 (tests/test_dht_records.py). Readiness still comes from `add_reader`; the read itself
    blocks until the whole request is there.
    """

    def patched(self) -> None:
        pipe = self._inner_pipe
        recv = pipe.recv

        def blocking_recv():
            os.set_blocking(pipe.fileno(), True)
            return recv()

        pipe.recv = blocking_recv
        run(self)

    patched.pathswarm_whole_requests = True
    return patched


if not getattr(hivemind.DHT.run, "pathswarm_whole_requests", False):
    hivemind.DHT.run = _whole_requests(hivemind.DHT.run)


def check_maddrs(maddrs: Sequence[str], flag: str, peer_ids: bool = False) -> list[str]:
    """The addresses, each parsed; with `peer_ids` (addresses of peers to dial), each must end in the
    peer's /p2p/<peer id>: p2pd refuses one without it, with only "invalid p2p multiaddr"."""
    out = []
    for m in maddrs:
        try:
            parsed = Multiaddr(m)
        except Exception as e:
            raise SwarmError(f"{flag}: {m!r} is not a multiaddress ({e})") from e
        if peer_ids and "p2p" not in {p.name for p in parsed.protocols()}:
            raise SwarmError(
                f"{flag}: {m} lacks its /p2p/<peer id> part: give the whole address the peer printed "
                f"(e.g. {m.rstrip('/')}/p2p/12D3KooW…)"
            )
        out.append(m)
    return out


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
    announce_maddrs: Sequence[str] = (),
    identity_path: str | os.PathLike | None = None,
    client_mode: bool = False,
    run_name: str | None = None,
    run_id: str | None = None,
    max_record_ttl_seconds: float = MAX_RECORD_TTL_SECONDS,
    startup_timeout_seconds: float = 30.0,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    public: bool = False,
    remember_validations: bool = True,
    admitted: Admitted | None = None,
    admitted_only: bool = False,
    creator_public_key: bytes | None = None,
) -> tuple[hivemind.DHT, RSAPrivateKey]:
    """Starts a DHT node that validates pathswarm's records for `run_name` (if given).

    `public` declares the node publicly reachable (a bootstrap node is, by definition: everyone
    dials it) so that it relays for peers behind NAT with usable limits at once. p2pd installs a
    circuit-relay handler at start with go-libp2p's default limits, 128 KiB and 2 minutes per
    relayed connection (too little for one module's state), and replaces it with its configured
    relay service (4 GiB, 30 minutes) only once AutoNAT finds the node public, which a small swarm
    may never confirm. `remember_validations=False` checks every record in full each time it
    arrives, as hivemind does (benchmarks/dht_scale.py measures both). `admitted(peer_id, token)`:
    the run's admission check, whose admitted peers' claims this node keeps first in a full shard;
    with `admitted_only` (an invite run) it keeps no others. `creator_public_key`: the run creator's,
    whose signature every router version this node stores must carry.
    """
    # before anything is made (an identity file, the daemon): a wrong address is the user's to fix
    initial_peers = check_maddrs(initial_peers, "--initial_peers", peer_ids=True)
    key, identity_file = load_identity(identity_path)
    validators: list = [RSASignatureValidator(key)]
    if run_name is not None:
        validators.append(
            RecordSchemaValidator(
                run_name,
                run_id,
                max_record_ttl_seconds,
                admitted,
                admitted_only=admitted_only,
                creator_public_key=creator_public_key,
            )
        )
    kwargs = dict(
        host_maddrs=check_maddrs(host_maddrs, "--host_maddrs"),
        announce_maddrs=check_maddrs(announce_maddrs, "--announce_maddrs") or None,
        client_mode=client_mode,
        nat_port_map=False,
        startup_timeout=startup_timeout_seconds,
        # libp2p circuit relays (hivemind's options, petals' flags): `use_relay` lets this node reach
        # and serve peers through relays; `use_auto_relay` makes a node behind NAT reserve a slot on
        # a relay so that others can reach it
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
    )
    if public and not use_auto_relay:
        kwargs["force_reachability"] = "public"
    if use_auto_relay:
        # a volunteer asks for a relay because no port can be opened: reserve a slot at once instead
        # of waiting for AutoNAT to conclude so from several peers' dial attempts (small swarms have
        # too few peers for that). The relays are the initial peers, named as static relays: p2pd
        # does not default to them, whatever its help text says. A relay only offers its public
        # addresses (go-libp2p drops private ones from circuit addresses), so a relay on a LAN
        # address cannot make anyone reachable.
        if not initial_peers:
            raise SwarmError("--use_auto_relay needs --initial_peers: the relays are the initial peers")
        kwargs["force_reachability"] = "private"
        kwargs["trusted_relays"] = list(initial_peers)
    kwargs["identity_path"] = str(identity_file)  # the signing key is the peer id, always
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers or None,
            start=True,
            record_validators=[RememberedValidation(validators)] if remember_validations else validators,
            **kwargs,
        )
    except Exception as e:
        raise SwarmError(explain_start_failure(e, initial_peers, str(identity_file))) from None
    finally:
        forget_ephemeral_identity(identity_file)  # the daemon has read it (or never will)
    serialize_calls(dht)
    return dht, key


class _SerialSends:
    """A connection whose `send` one thread at a time may use (the rest is the connection's own)."""

    def __init__(self, connection):
        self._connection, self._lock = connection, threading.Lock()

    def send(self, obj) -> None:
        with self._lock:
            self._connection.send(obj)

    def __getattr__(self, name):
        return getattr(self._connection, name)


def serialize_calls(dht: hivemind.DHT) -> hivemind.DHT:
    """Makes a started DHT's calls safe from several threads at once.

    hivemind 1.1.12's DHT client writes every call (get, store, run_coroutine) into one pipe to the
    DHT's process (`DHT._outer_pipe`) without a lock. A call is a pickled message whose bytes go out in
    more than one write once it is larger than the pipe takes at once, so two threads calling at the
    same moment can interleave them: the DHT process then unpickles garbage and dies (seen here with
    8 threads storing 40 kB values). A peer calls its DHT from its heartbeat, its training loop and its
    services' threads, so every send takes this lock; the calls themselves, and the waits for their
    answers, still run side by side."""
    if not isinstance(dht._outer_pipe, _SerialSends):
        dht._outer_pipe = _SerialSends(dht._outer_pipe)
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The addresses p2pd announces now (relay addresses appear after start, so never the cache)."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


def owner_subkey(key: RSAPrivateKey) -> bytes:
    """The subkey under which only `key`'s holder may write (checked by RSASignatureValidator)."""
    return RSASignatureValidator(key).local_public_key
