"""The run's authority: the creator's own node, which admits keys (`pathswarm bootstrap
--manifest_path M --identity_path CREATOR_KEY`, started with the key that signed the manifest).

It answers `Kind.ADMIT` requests on its sync service:

* with an invite code: a code `pathswarm run invite` wrote into `M.invites.json` (only its sha256 is
  kept there) admits the first key that redeems it, and that key again later (a peer that lost its
  token); any other key is refused. A code unknown or redeemed by another key is refused from the
  invites as last read, read again only when the file has changed, so a stranger's guess costs a
  `stat` and a lookup, not a parse of the whole file under its lock. The file is rewritten
  atomically on every use, and read and rewritten under an exclusive lock (`invites_locked`):
  redemptions run on executor threads, and two at once each wrote back what it had read, so one
  undid the other's and a redeemed code could be redeemed again by another key (seen in CI).
* without one, in an `open` run: the key must hold a claim, have paid the run's key cost if it asks
  for one (`key_cost_bits`), and admitted holders of its modules must say that they averaged at least
  `probation_rounds` of its outer gradients (`Kind.STANDING`, asked of each; a strict majority of
  those that answer, where at least one does). Admissions per hour are capped
  (`admissions_per_hour`): a flood of keys waits its turn instead of outnumbering the run.

Where no holder of the key's modules has standing yet (the first peers of an open run), holders
without admission vouch instead: the first holders of a module are admitted on each other's word,
which is the weak start an open run has, said in the threat model.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from dht.schema import ClaimRecord, ManifestRecord
from peer.codecs.formats import make_codec
from peer.config import RunManifest
from peer.run.admission import AdmissionCheck, pow_ok, sign_admission
from peer.swarm.claims import ClaimView
from peer.sync import wire
from peer.sync.inbox import Inbox
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: seconds the authority waits for a holder's answer about a key's probation
STANDING_TIMEOUT_SECONDS = 5.0


def invites_path(manifest_path: Path) -> Path:
    """Where a run's invite codes are kept: beside its manifest file."""
    manifest_path = Path(manifest_path)
    return manifest_path.with_name(manifest_path.stem + ".invites.json")


def new_invite_code() -> str:
    """A fresh invite code: 128 random bits in hex, so that it never starts with "-" (which a
    command line would read as a flag after --invite) and survives any copy and paste."""
    return secrets.token_hex(16)


def code_digest(code: str) -> str:
    return hashlib.sha256(code.strip().encode()).hexdigest()


def read_invites(path: Path) -> dict[str, dict]:
    """sha256 of a code -> {"peer_id": the key that redeemed it, or None, "used_at": ...}."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the invites in {path}: {e}") from None


def write_invites(path: Path, invites: dict[str, dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(invites, indent=1, sort_keys=True))
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@contextmanager
def invites_locked(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on a file beside `path` (between threads as between processes:
    the authority's redemptions and `pathswarm run invite`) for a read, change and write of it."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor of the open file releases the lock


class AdmissionAuthority:
    """Admits keys to one run, by invite code or after probation, with the creator's key."""

    def __init__(
        self,
        service: SyncService,
        key: RSAPrivateKey,
        manifest: RunManifest,
        record: ManifestRecord,
        invites: Path | None,
        read_claims: Callable[[], dict[str, ClaimRecord]],
    ):
        """`read_claims()` reads the run's current claims (a DHT read: it runs off the service loop)."""
        if key.get_public_key().to_bytes() != record.creator_public_key:
            raise ValueError("only the key that signed the run's manifest admits keys to it")
        self.service, self.key, self.manifest, self.record = service, key, manifest, record
        self.invites = invites
        self.read_claims = read_claims
        self.granted: deque[float] = deque()  # when recent probation admissions were granted
        #: the invites file as last read: its (inode, size, mtime) and its entries
        self._invites_read: tuple[tuple[int, int, int] | None, dict[str, dict]] | None = None
        service.extra_handlers[Kind.ADMIT] = self._on_admit

    async def _on_admit(self, sender: str, body: bytes, reader, writer) -> None:
        request = wire.parse(wire.AdmitRequest, body)
        try:
            if request.run != self.service.run:
                raise PermissionError("another run")
            via = await self._decide(sender, request)
        except PermissionError as e:
            logger.info(f"authority: not admitting {sender}: {e}")
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason=str(e)[:256])))
            return
        token = sign_admission(self.key, self.record.run_id, sender, via)
        logger.info(f"authority: admitted {sender} ({via})")
        frames = [
            wire.pack_header(Kind.ACK, Ack(ok=True)),
            wire.pack_header(Kind.ADMITTED, wire.Admitted(token=token)),
        ]
        await wire.write(writer, *frames)

    async def _decide(self, sender: str, request: wire.AdmitRequest) -> str:
        """How `sender` is admitted ("invite" or "probation"); PermissionError with the reason if not."""
        loop = asyncio.get_running_loop()
        if request.invite:
            entry = await self._known_invite(request.invite)
            if entry.get("peer_id") not in (None, sender):
                raise PermissionError("this invite code was redeemed by another key")
            # the redemption itself reads and writes the file under its lock: a code redeemed since
            # the read above is refused there
            return await loop.run_in_executor(None, self._redeem, sender, request.invite)
        config = self.manifest.admission
        if config.mode == "invite":
            raise PermissionError("this run admits invited keys only: ask its creator for an invite code")
        if not pow_ok(self.record.run_id, sender, request.nonce, config.key_cost_bits):
            raise PermissionError(f"the run asks for a key cost of {config.key_cost_bits} bits")
        now = time.monotonic()
        while self.granted and now - self.granted[0] > 3600:
            self.granted.popleft()
        if len(self.granted) >= config.admissions_per_hour:
            raise PermissionError(f"{config.admissions_per_hour} keys admitted in the last hour: try later")
        vouched, asked = await self._probation(sender)
        if not 2 * vouched > asked or not asked:
            raise PermissionError(
                f"on probation: {vouched} of {asked} holders with standing saw {config.probation_rounds} "
                "of its outer gradients averaged"
            )
        self.granted.append(time.monotonic())
        return "probation"

    async def _known_invite(self, code: str) -> dict:
        """The entry of `code` in the invites as last read; PermissionError if there is none. The file
        is read again (off the service loop) only when its inode, size or mtime changed: `run invite`
        and redemptions replace it whole."""
        if self.invites is None:
            raise PermissionError("this node keeps no invites")
        try:
            st = os.stat(self.invites)
            identity: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            identity = None
        if self._invites_read is None or self._invites_read[0] != identity:
            invites: dict[str, dict] = {}
            if identity is not None:
                try:
                    invites = await asyncio.get_running_loop().run_in_executor(
                        None, read_invites, self.invites
                    )
                except ValueError as e:
                    logger.error(f"authority: {e}")
                    raise PermissionError("the authority cannot read its invites") from None
            self._invites_read = (identity, invites)
        entry = self._invites_read[1].get(code_digest(code))
        if entry is None:
            raise PermissionError("unknown invite code")
        return entry

    def _redeem(self, sender: str, code: str) -> str:
        if self.invites is None:
            raise PermissionError("this node keeps no invites")
        with invites_locked(self.invites):
            try:
                invites = read_invites(self.invites)
            except ValueError as e:
                logger.error(f"authority: {e}")
                raise PermissionError("the authority cannot read its invites") from None
            entry = invites.get(code_digest(code))
            if entry is None:
                raise PermissionError("unknown invite code")
            if entry.get("peer_id") not in (None, sender):
                raise PermissionError("this invite code was redeemed by another key")
            if entry.get("peer_id") is None:
                invites[code_digest(code)] = {"peer_id": sender, "used_at": time.time()}
                write_invites(self.invites, invites)
        return "invite"

    async def _probation(self, sender: str) -> tuple[int, int]:
        """(holders that vouch for `sender`, holders that answered): the holders with standing of its
        modules, asked how many of its outer gradients they averaged."""
        loop = asyncio.get_running_loop()
        claims = await loop.run_in_executor(None, self.read_claims)
        claim = claims.get(sender)
        if claim is None:
            raise PermissionError("no claim in the run: train first")
        standing = self.service.inbox.standing
        k = self.manifest.admission.probation_rounds
        best: dict[str, int] = {}

        async def ask(holder: str, module: str) -> None:
            query = wire.StandingQuery(run=self.service.run, module=module, peer=sender)
            try:
                ack = await self.service.request(
                    holder, [wire.pack_header(Kind.STANDING, query)], STANDING_TIMEOUT_SECONDS
                )
                count = int(ack.reason) if ack.ok and ack.reason.isdigit() else 0
            except Exception as e:
                logger.debug(f"authority: {holder} did not say ({type(e).__name__})")
                return
            best[holder] = max(best.get(holder, 0), count)

        asks = []
        for module in claim.modules:
            holders = [p for p, c in claims.items() if module in c.modules and p != sender]
            asks += [ask(h, module) for h in standing.among(holders)]
        await asyncio.gather(*asks)
        return sum(count >= k for count in best.values()), len(best)


def start_authority(
    dht,
    key: RSAPrivateKey,
    manifest: RunManifest,
    record: ManifestRecord,
    manifest_path: Path,
    dht_lock,
    service: SyncService | None = None,
) -> tuple[AdmissionAuthority, SyncService | None]:
    """The authority of a run on the creator's node: on `service` (a keeper's) or a sync service of
    its own, which it returns for the caller to shut down."""
    view = ClaimView.of_run(manifest, record)
    claims: dict[str, ClaimRecord] = {}

    def read_claims() -> dict[str, ClaimRecord]:
        with dht_lock:
            fresh = view.update(dht)
        claims.clear()
        claims.update(fresh)
        return claims

    def token_of(peer: str) -> str:
        claim = claims.get(peer)
        return claim.admission if claim is not None else ""

    own = None
    if service is None:
        standing = Standing(AdmissionCheck.of(record), manifest.admission.mode, token_of, str(dht.peer_id))
        inbox = Inbox({}, make_codec(manifest.sync.codec), lambda p, m: False, 1, 0.0, standing)
        service = own = SyncService(
            dht, record.run_id, inbox, manifest.sync.averaging_timeout_seconds, key=key
        )
    authority = AdmissionAuthority(service, key, manifest, record, invites_path(manifest_path), read_claims)
    logger.info(f"admitting keys to run {manifest.name} ({manifest.admission.mode}) as its creator")
    return authority, own


def serve_if_creator(
    service: SyncService,
    key: RSAPrivateKey,
    manifest: RunManifest,
    record: ManifestRecord,
    manifest_path: Path | None,
    read_claims: Callable[[], dict[str, ClaimRecord]],
) -> AdmissionAuthority | None:
    """The authority on a peer's own sync service, if the peer runs with the key that created the run
    and was given its manifest file (whose folder keeps the invites): the researcher's own peer admits
    the run's volunteers. None otherwise."""
    if manifest_path is None or key.get_public_key().to_bytes() != record.creator_public_key:
        return None
    logger.info(f"admitting keys to run {manifest.name} ({manifest.admission.mode}) as its creator")
    return AdmissionAuthority(service, key, manifest, record, invites_path(manifest_path), read_claims)
