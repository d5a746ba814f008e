"""Admission to a run: the creator's signature on a key, so that no decision counts raw keys.

A key costs milliseconds, so any vote, confirmation or majority that counts keys belongs to whoever
makes the most of them. A run's manifest says how keys earn standing (`AdmissionConfig.mode`):

* `invite` — only keys the run's creator signed an admission for take part: a stranger's outer
  gradients, reports, state requests and keep requests are refused. A volunteer gets one with an
  invite code the creator hands out (`pathswarm run invite`), redeemed by its peer at start, or as a
  token the creator signs for its peer id (`pathswarm run admit`).
* `open` — anyone trains, but a key's reports, votes, confirmations and keeping count only once the
  creator's authority admitted it, after admitted holders accepted `probation_rounds` of its outer
  gradients; until then its parts are weighed against the admitted members' aggregate
  (`peer.sync.aggregate`). Where a group has no admitted member at all (an open run whose creator
  runs no authority), its members count alike, as in an unpermissioned swarm: said in the threat
  model, not hidden.

An admission is a small JSON payload (run, peer id, how it was earned, when) and the creator's RSA
signature over its sha256, as one printable token. Peers carry their token in their claim, in every
outer gradient's header and in every signed report, so every member of a round sees the same
standing for every sender and decides alike. Only the manifest's creator key signs admissions: it is
the key every peer already trusts with the run itself. A node's DHT validator ranks admitted peers'
claims first where a claim shard is full (`run_validator`, dht/shard_store.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections import OrderedDict
from typing import Literal

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dht.identity import peer_id_of_owner
from dht.schema import MAX_ADMISSION_TOKEN_CHARS, ManifestRecord
from dht.validators import RecordSchemaValidator
from peer.config import RunManifest


class Admission(BaseModel):
    """What the creator signs: `peer_id` takes part in run `run_id` with standing, earned `via`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=64, max_length=64)
    peer_id: str = Field(min_length=1, max_length=128)
    via: Literal["invite", "probation"]
    issued_at: float = 0.0


def _digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).hexdigest().encode()


def sign_admission(key: RSAPrivateKey, run_id: str, peer_id: str, via: str) -> str:
    """The token admitting `peer_id` to the run, signed with the creator's `key`."""
    admission = Admission(run_id=run_id, peer_id=peer_id, via=via, issued_at=round(time.time(), 3))
    payload = admission.model_dump_json().encode()
    signature = key.sign(_digest(payload))  # hivemind returns it base64-encoded already
    return base64.urlsafe_b64encode(payload).decode() + "." + signature.decode()


def read_admission(token: str, run_id: str, creator_public_key: bytes) -> Admission:
    """The admission inside `token`, or ValueError saying why it does not admit anyone to this run."""
    if not token or len(token) > MAX_ADMISSION_TOKEN_CHARS or token.count(".") != 1:
        raise ValueError("not an admission token")
    encoded, signature = token.split(".")
    try:
        payload = base64.urlsafe_b64decode(encoded.encode())
        valid = RSAPublicKey.from_bytes(creator_public_key).verify(_digest(payload), signature.encode())
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"unreadable admission token ({type(e).__name__})") from None
    if not valid:
        raise ValueError("admission not signed by the run's creator")
    try:
        admission = Admission.model_validate_json(payload)
    except ValidationError:
        raise ValueError("admission payload does not parse") from None
    if admission.run_id != run_id:
        raise ValueError("admission for another run")
    return admission


class AdmissionCheck:
    """Whether a token admits a given peer to one run; remembers verified tokens (a signature check
    costs a quarter of a millisecond, and the same tokens arrive in every header and report). The
    creator's own key (its bootstrap node, keeper or authority) needs no token: it signs them."""

    def __init__(self, run_id: str, creator_public_key: bytes, max_entries: int = 4096):
        self.run_id = run_id
        self.creator_public_key = creator_public_key
        self.creator_peer_id = peer_id_of_owner(creator_public_key)
        self.max_entries = max_entries
        self._known: OrderedDict[str, str | None] = OrderedDict()  # token -> peer id it admits, or None

    @classmethod
    def of(cls, record) -> AdmissionCheck:
        """The check for the run of a verified `ManifestRecord`."""
        return cls(record.run_id, record.creator_public_key)

    def admitted(self, peer_id: str, token: str) -> bool:
        """True if `token` is the creator's admission of exactly `peer_id` to this run (or `peer_id`
        is the creator's own key)."""
        if peer_id == self.creator_peer_id:
            return True
        if not token:
            return False
        if token not in self._known:
            try:
                self._known[token] = read_admission(token, self.run_id, self.creator_public_key).peer_id
            except ValueError:
                self._known[token] = None
            if len(self._known) > self.max_entries:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(token)
        return self._known[token] == peer_id


def pow_ok(run_id: str, peer_id: str, nonce: int, bits: int) -> bool:
    """A key's cost, where a run asks for one: sha256(run id, peer id, nonce) starts with `bits` zero
    bits (hashcash). Checked by the authority before it admits a key."""
    if bits <= 0:
        return True
    digest = hashlib.sha256(f"{run_id}:{peer_id}:{nonce}".encode()).digest()
    return int.from_bytes(digest, "big") >> (256 - bits) == 0


def solve_pow(run_id: str, peer_id: str, bits: int) -> int:
    """The first nonce that satisfies `pow_ok` (about 2**bits hashes: 2**22 take seconds)."""
    nonce = 0
    while not pow_ok(run_id, peer_id, nonce, bits):
        nonce += 1
    return nonce


def invite_only(record: ManifestRecord) -> bool:
    """Whether the run of a verified manifest `record` admits invited keys only."""
    return RunManifest.model_validate_json(record.manifest_json).admission.mode == "invite"


def run_validator(record: ManifestRecord, run_name: str) -> RecordSchemaValidator:
    """The validator of a run's records for a node that verified its manifest `record`: its claim
    shards keep admitted peers' claims first when full, and in an invite run no others at all; it
    stores only router versions the run's creator signed."""
    check = AdmissionCheck.of(record)
    return RecordSchemaValidator(
        run_name,
        record.run_id,
        admitted=check.admitted,
        admitted_only=invite_only(record),
        creator_public_key=record.creator_public_key,
    )
