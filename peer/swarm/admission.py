"""A peer's own admission to a run: the token it carries, where it comes from, where it is kept.

In order: `--admission` (a token, or a file holding one, that the creator signed with `pathswarm run
admit`), the token kept in `--checkpoint_dir` from an earlier start, or an invite code (`--invite`,
from `pathswarm run invite`) redeemed once with the run's authority — the creator's own node, whose
peer id the manifest's creator key gives. An invite run refuses to start without one, with a line
saying how to get one. In an open run a peer without a token trains on probation and asks the
authority now and then (`seek`); the authority admits it once admitted holders averaged enough of its
outer gradients (peer/swarm/authority.py). Every token is checked against the run's creator key
before it is used or kept: a token for another run or another key is a one-line error, not a
silently useless claim field.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import hivemind
from hivemind.p2p import P2P, PeerID

from dht.background_loop import BackgroundLoop
from dht.schema import ManifestRecord
from peer.config import PeerConfig, RunManifest
from peer.errors import ConfigError, SwarmError
from peer.run.admission import AdmissionCheck, read_admission, solve_pow
from peer.sync import wire
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: the file in --checkpoint_dir that keeps a peer's admission across restarts
TOKEN_FILE = "admission.token"


def _given(value: str) -> str:
    """`--admission`: a file holding the token, or the token itself."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a token is too long to be a file name
        is_file = False
    if not is_file:
        return value.strip()
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read --admission file {path}: {e.strerror}") from None


def _check(token: str, record: ManifestRecord, peer_id: str, where: str) -> str:
    try:
        admission = read_admission(token, record.run_id, record.creator_public_key)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if admission.peer_id != peer_id:
        raise ConfigError(
            f"{where} admits {admission.peer_id}, not this peer ({peer_id}): use the --identity_path it "
            "was made for, or ask the run's creator for one for this key"
        )
    return token


def save_token(checkpoint_dir: Path | None, token: str) -> None:
    """Keeps the token beside the checkpoints (mode 0600), so a restart needs no code again."""
    if checkpoint_dir is None or not token:
        return
    path = Path(checkpoint_dir) / TOKEN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(token)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def obtain_admission(
    dht: hivemind.DHT, cfg: PeerConfig, manifest: RunManifest, record: ManifestRecord, peer_id: str
) -> str:
    """This peer's admission token ("" on probation in an open run); raises ConfigError where an
    invite run cannot be joined without one, SwarmError where the authority refused an invite."""
    if AdmissionCheck.of(record).creator_peer_id == peer_id:
        return ""  # the creator's own key needs no admission
    if cfg.admission:
        return _check(_given(cfg.admission), record, peer_id, "--admission")
    kept = Path(cfg.checkpoint_dir) / TOKEN_FILE if cfg.checkpoint_dir is not None else None
    if kept is not None and kept.is_file():
        return _check(kept.read_text().strip(), record, peer_id, f"the admission kept in {kept}")
    if cfg.invite:
        token = _check(
            request_admission(dht, record, invite=cfg.invite), record, peer_id, "the authority's answer"
        )
        save_token(cfg.checkpoint_dir, token)
        logger.info("invite code redeemed: this peer is admitted to the run")
        return token
    if manifest.admission.mode == "invite":
        raise ConfigError(
            f"run {manifest.name} admits invited keys only: pass --invite CODE (from its creator's "
            "pathswarm run invite) or --admission TOKEN (pathswarm run admit --peer_id " + peer_id + ")"
        )
    logger.info("no admission yet: training on probation (votes count once the run's authority admits us)")
    return ""


def seek(dht: hivemind.DHT, manifest: RunManifest, record: ManifestRecord, peer_id: str) -> str:
    """An open run's admission after probation, if the authority grants it now ("" if not yet)."""
    bits = manifest.admission.key_cost_bits
    nonce = solve_pow(record.run_id, peer_id, bits) if bits else 0
    try:
        token = request_admission(dht, record, nonce=nonce)
    except SwarmError as e:
        logger.debug(f"not admitted yet: {e}")
        return ""
    try:
        return _check(token, record, peer_id, "the authority's answer")
    except ConfigError as e:
        logger.warning(f"the run's authority sent an admission that does not hold: {e}")
        return ""


def request_admission(
    dht: hivemind.DHT, record: ManifestRecord, invite: str = "", nonce: int = 0, timeout: float = 30.0
) -> str:
    """Asks the run's authority (the creator's node) for an admission; its token, or SwarmError with
    the authority's reason. The request goes over a P2P replica of its own that registers no handler,
    so the peer's own sync service is not disturbed."""
    authority = AdmissionCheck.of(record).creator_peer_id
    request = wire.AdmitRequest(run=record.run_id[:16], invite=invite, nonce=nonce)

    async def ask() -> str:
        daemon = dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)
        p2p = await P2P.replicate(daemon)
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(
                PeerID.from_base58(authority), wire.PROTOCOL
            )
            try:
                await wire.write(writer, wire.pack_header(Kind.ADMIT, request))
                ack = wire.parse(Ack, (await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES))[1])
                if not ack.ok:
                    raise SwarmError(f"the run's authority refused: {ack.reason}")
                _, body = await wire.read_frame(reader, {Kind.ADMITTED}, wire.MAX_HEADER_BYTES)
                return wire.parse(wire.Admitted, body).token
            finally:
                writer.close()
        finally:
            await p2p.shutdown()

    loop = BackgroundLoop("admission")
    try:
        return loop.call(asyncio.wait_for(ask(), timeout), timeout + 5)
    except SwarmError:
        raise
    except Exception as e:
        raise SwarmError(
            f"could not reach the run's authority {authority[:16]}… (the creator's node): "
            f"{type(e).__name__}: {e}"
        ) from None
    finally:
        loop.stop()
