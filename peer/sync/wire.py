"""The sync protocol's messages and framing on a hivemind P2P stream, with every size capped first.

A frame is one kind byte, a 4-byte big-endian length and the body. The reader knows the largest
body each kind may have before it reads one byte of it (hivemind's own framing reads whatever
length the sender declares), so no peer can make another allocate more than the protocol allows:
headers are msgpack maps of at most `MAX_HEADER_BYTES`, and a payload's exact size follows from a
header the receiver has already validated against its own model.

Headers are versioned pydantic schemas; unknown fields from newer peers are ignored, malformed
known fields refuse the message.
"""

from __future__ import annotations

import asyncio
import enum
import re
from typing import Annotated, Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dht.schema import MAX_ADMISSION_TOKEN_CHARS

PROTOCOL = "pathswarm_sync_v4"  # v2: signed, relayed reports; admissions in headers; v3: echoes by digest;
# v4: norms in the aggregation add their squares in lanes (`aggregate._fixed_order_sum`): other bits
MAX_HEADER_BYTES = 64 * 1024
#: reporters an echo may name (each with at most two reports: an equivocator's); a round's cap
MAX_ECHO_REPORTERS = 256
#: the refusal a peer answers a STANDING query with while it starts (`SyncService.training` unset)
STARTING = "starting"
#: the refusal of a SIT_OUT notice by a member that applied that round already (its window is past it)
PAST_ROUND = "past the round"
#: numbers per PAYLOAD frame of a state download (4 MiB): what a receiver holds unread at most
STATE_CHUNK_NUMBERS = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_MODULE = re.compile(r"^(trunk|l\d+m\d+|p\d+)$")


class Kind(enum.IntEnum):
    """The first byte of a frame: what the body is."""

    DELTA = 1  # DeltaHeader, answered by ACK "go" or a refusal; then PAYLOAD, answered by an ACK
    REPORT = 2  # Report; answered with an ACK
    STATE_REQUEST = 3  # StateRequest; answered with STATE_HEADER and PAYLOAD frames, or an ACK refusing
    STATE_HEADER = 4
    CONFIRM = 5  # Confirm; answered with an ACK whose `ok` says whether the digest matches
    PAYLOAD = 6
    ACK = 7
    KEEP = 8  # Keep: "take my state of this module now" (a last holder leaving); answered with an ACK
    COPY_REQUEST = 9  # CopyRequest; answered with an ACK, then (if ok) θ̄ and momentum as two PAYLOADs
    ECHO = 10  # Echo (the reports the sender holds, by digest); an ACK, or NEED then those REPORTs and an ACK
    PART_REQUEST = 11  # PartRequest; answered with an ACK, then (if ok) the DELTA header and its PAYLOAD
    ADMIT = 12  # AdmitRequest to a run's authority; answered with an ACK, then (if ok) an ADMITTED frame
    ADMITTED = 13  # Admitted: the token
    STANDING = 14  # StandingQuery; an ACK whose reason is the count, as decimal digits (or STARTING)
    BYE = 15  # Bye: "I leave these modules now (moving or stopping): do not wait for me"; an ACK
    HELLO = 16  # Hello: "I hold these modules now: read my claim"; an ACK once the claim is seen
    SIT_OUT = 17  # SitOut: "I send nothing more for this round (I sent it already)": an ACK
    REPORT_REQUEST = 18  # ReportRequest; answered with an ACK, then (if ok) the REPORT frame
    NEED = 19  # Need: the receiver of an ECHO asks for the reports it names that it lacks


class WireError(ValueError):
    """A peer sent something the protocol does not allow; the stream is closed."""


class Header(BaseModel):
    """Fields every request carries: the protocol version and the run (first 16 hex digits of its id)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = Field(1, ge=1, le=1)
    run: str = Field(min_length=16, max_length=16)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        if not _HEX.match(v):
            raise ValueError("run must be hex")
        return v


class RoundKey(BaseModel):
    """One sync of one fragment of one module: the round is the fragment's count of applied syncs,
    equal on every holder whose copy is in step."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    module: str = Field(max_length=16)
    fragment: int = Field(ge=0, lt=64)
    round: int = Field(ge=0, lt=2**40)

    @field_validator("module")
    @classmethod
    def _module(cls, v: str) -> str:
        if not _MODULE.match(v):
            raise ValueError(f"bad module id {v!r}")
        return v

    def as_tuple(self) -> tuple[str, int, int]:
        return (self.module, self.fragment, self.round)


class DeltaHeader(Header):
    """A member's outer gradient for a round: what the payload that follows holds, and its size."""

    key: RoundKey
    #: tokens the sender trained since its last sync of this fragment (a claim: capped by the group)
    weight: float = Field(gt=0, le=1e12, allow_inf_nan=False)
    codec: str = Field(max_length=16)
    numel: int = Field(ge=0, lt=2**34)
    payload_bytes: int = Field(ge=0, lt=2**36)
    #: the sender's admission to the run ("" on probation): every member sees the same standing
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)


class Report(Header):
    """What one member received for a round (sender -> digest of its weight, standing and payload,
    itself included) and the digest of its own copy of the fragment before the round, signed by the
    reporter's key so that others can relay it (`peer.sync.reports`)."""

    key: RoundKey
    received: dict[str, str] = Field(max_length=256)
    state_digest: str = Field(max_length=64)
    reporter: str = Field("", max_length=128)
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)
    #: the reporter's RSA public key (OpenSSH form; its hash is the reporter's peer id) and signature
    public_key: str = Field("", max_length=1024)
    signature: str = Field("", max_length=1024)


PeerIdText = Annotated[str, Field(max_length=128)]
DigestText = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Echo(Header):
    """Names the signed reports of a round the sender holds, each by reporter and digest
    (`peer.sync.reports.report_digest`), so that every member decides on the same reports and a
    member that told members different things is caught. The receiver asks for those it lacks
    (`Need`); a member usually holds them all already (each reporter pushed its own), and relaying
    every report to every member cost a group of n members n² reports a round each."""

    key: RoundKey
    held: list[tuple[PeerIdText, DigestText]] = Field(max_length=2 * MAX_ECHO_REPORTERS)


class Need(BaseModel):
    """The answer to an `Echo`: the positions in its `held` of the reports to send, in that order."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    indices: list[Annotated[int, Field(ge=0, lt=2 * MAX_ECHO_REPORTERS)]] = Field(
        min_length=1, max_length=2 * MAX_ECHO_REPORTERS
    )

    @field_validator("indices")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        # each report at most once: a member cannot make an echoer send one report many times
        if any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("indices must be strictly increasing")
        return v


class PartRequest(Header):
    """Asks a member for the outer gradient `sender` sent it for a round, the one with `digest`: a
    member that missed a part the group agreed on takes it from one that has it."""

    key: RoundKey
    sender: str = Field(max_length=128)
    digest: str = Field(min_length=64, max_length=64)


class ReportRequest(Header):
    """Asks a member for its own signed report of a round: a member that holds its part but not its
    report (the report's push failed) would otherwise decide without it and count other parts."""

    key: RoundKey


class AdmitRequest(Header):
    """Asks the run's authority to admit the requesting key: with an invite code, or after probation
    (with the proof of work the run asks for, if any)."""

    invite: str = Field("", max_length=128)
    nonce: int = Field(0, ge=0, lt=2**63)


class Admitted(BaseModel):
    """The authority's answer: the signed admission token."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    token: str = Field(max_length=MAX_ADMISSION_TOKEN_CHARS)


class Bye(Header):
    """The sender stops holding `modules` now (it moves to another path, or leaves): its rounds of
    them are not waited for. About itself only, so its word is enough."""

    modules: list[str] = Field(max_length=64)


class Hello(Header):
    """The sender holds `modules` now (it moved to a path through them): read the claims again. A hint:
    the receiver counts the sender's claim as read from the DHT, not this message."""

    modules: list[str] = Field(max_length=64)


class SitOut(Header):
    """The sender sends no part and no report for round `key` (it sent them already: before a restart,
    or before a download set its state back to that round): do not wait for them. What it sent
    before still counts as the round's voters agree. About itself only, so its word is enough."""

    key: RoundKey


class StandingQuery(Header):
    """Asks a holder of `module` in how many of its rounds `peer`'s outer gradient was averaged."""

    module: str = Field(max_length=16)
    peer: str = Field(max_length=128)


class StateRequest(Header):
    """Asks for a module's global copy and outer momentum, or for the numbers [start, stop) of it (θ̄
    of every fragment, then every momentum, as one run of float32): a joiner takes parts of one
    state from several holders at once. `fragment_rounds` names the state wanted (None: the current
    one), so that every part comes from the same state even while the holders' rounds move on."""

    module: str = Field(max_length=16)
    start: int = Field(0, ge=0, lt=2**40)
    stop: int | None = Field(None, ge=0, lt=2**40)
    fragment_rounds: list[int] | None = Field(None, max_length=64)


class StateHeader(Header):
    """Precedes a module's state: its fragment rounds and the size of each tensor that follows."""

    module: str = Field(max_length=16)
    fragment_rounds: list[int] = Field(max_length=64)
    #: numbers in each tensor of the state (θ̄ per fragment, then momentum per fragment)
    numels: list[int] = Field(max_length=128)
    #: the numbers of the state that follow, in PAYLOAD frames of at most `STATE_CHUNK_NUMBERS` each
    start: int = Field(0, ge=0, lt=2**40)
    stop: int = Field(0, ge=0, lt=2**40)


class Confirm(Header):
    """ "Was your copy of `module` at `fragment_rounds` the state with `digest`?" (fragment digests)."""

    module: str = Field(max_length=16)
    fragment_rounds: list[int] = Field(max_length=64)
    digests: list[str] = Field(max_length=64)


class Keep(Header):
    """A holder about to leave asks a keeper to take its state of `module` before it goes."""

    module: str = Field(max_length=16)


class CopyRequest(Header):
    """Asks a member for the copy of one fragment it reported in a round: the copy whose state digest
    is `digest` (`peer.sync.merge`)."""

    module: str = Field(max_length=16)
    fragment: int = Field(ge=0, le=4096)
    digest: str = Field(min_length=64, max_length=64)


class Ack(BaseModel):
    """The answer to a request: accepted ("go" between frames), or refused and why."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ok: bool
    reason: str = Field("", max_length=256)


H = TypeVar("H", bound=BaseModel)


def pack(kind: Kind, body: bytes) -> bytes:
    return bytes([kind]) + len(body).to_bytes(4, "big") + body


def pack_header(kind: Kind, header: BaseModel) -> bytes:
    return pack(kind, msgpack.packb(header.model_dump(mode="json"), use_bin_type=True))


async def read_frame(reader: asyncio.StreamReader, expect: set[Kind], max_bytes: int) -> tuple[Kind, bytes]:
    """One frame of an expected kind whose body is at most `max_bytes`, checked before reading it."""
    head = await reader.readexactly(5)
    try:
        kind = Kind(head[0])
    except ValueError:
        raise WireError(f"unknown frame kind {head[0]}") from None
    if kind not in expect:
        raise WireError(f"unexpected {kind.name} frame")
    length = int.from_bytes(head[1:], "big")
    if length > max_bytes:
        raise WireError(f"{kind.name} frame of {length} bytes exceeds its cap of {max_bytes}")
    return kind, await reader.readexactly(length)


def parse(schema: type[H], body: bytes) -> H:
    try:
        data: Any = msgpack.unpackb(body, raw=False, strict_map_key=True)
        return schema.model_validate(data)
    except (ValueError, TypeError, ValidationError, msgpack.ExtraData, msgpack.FormatError) as e:
        raise WireError(f"malformed {schema.__name__}: {str(e).splitlines()[0][:200]}") from None


async def read_header(reader: asyncio.StreamReader, kind: Kind, schema: type[H]) -> H:
    _, body = await read_frame(reader, {kind}, MAX_HEADER_BYTES)
    return parse(schema, body)


async def write(writer: asyncio.StreamWriter, *frames: bytes) -> None:
    for frame in frames:
        writer.write(frame)
    await writer.drain()
