"""Serving artifacts to other peers and fetching them from several at once, chunk by verified chunk.

A peer offers the artifacts of its run that it holds complete (`offer`) and says so in the DHT
(`publish`: one signed `ArtifactsRecord` under its own subkey). A fetcher reads who offers an
artifact, takes the chunk list from the first source whose list matches the manifest's
`chunks_sha256`, and pulls the missing chunks from all sources in parallel. A chunk of the wrong
length or digest drops its source for the rest of the download (it is lying or broken) and the chunk
goes to another; a source that times out twice is dropped too. Requests are a few bytes of JSON and
every reply is checked against the length the manifest implies, so neither side can be made to
allocate more than one chunk by the other.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import deque
from pathlib import Path

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from tqdm import tqdm

from dht.keys import ARTIFACTS_TTL_SECONDS, artifacts_key
from dht.p2p_handler import P2PHandler
from dht.records import read_records, store_record
from dht.schema import ArtifactsRecord
from dht.serve_limits import ServeLimits
from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactError, ArtifactStore

logger = logging.getLogger(__name__)

HANDLER = "pathswarm_artifact"
MAX_REQUEST_BYTES = 256
#: a reply's dtype when the chunk is not sent now because of the server's upload limits
BUSY = "busy"
#: how long a fetcher waits before it asks a busy source again, and how many busy answers it takes
BUSY_RETRY_SECONDS = 1.0
MAX_BUSY_ANSWERS = 300
#: chunk requests in flight at once, over all sources
PARALLEL_REQUESTS = 4
REQUEST_TIMEOUT_SECONDS = 30.0
#: failures (timeouts, refusals) after which a source is given up for this download
MAX_SOURCE_FAILURES = 2
#: below the callers' own one-minute loops, so that each of their passes re-publishes
REPUBLISH_SECONDS = 50.0
#: sources one download tries at most: anyone can publish an ArtifactsRecord, and a flood of
#: records naming dead peers would otherwise cost one request timeout each
MAX_SOURCES = 32


class _Busy(Exception):
    """The source is over its upload limits (`ServeLimits`) for now."""


class _BadChunk(Exception):
    """A reply that cannot be the artifact's: wrong length or digest. Its source is lying or broken."""


class ArtifactService:
    """Serves `offer`ed artifacts from `store` and fetches others into it, over a P2P replica."""

    def __init__(self, dht: hivemind.DHT, store: ArtifactStore, limits: ServeLimits | None = None):
        """`limits`: what askers can make us upload (the defaults if None); nobody asking for an
        artifact has standing that this service could check, so all of them share the strangers' part."""
        self.store = store
        self.limits = limits if limits is not None else ServeLimits()
        self.peer_id = str(dht.peer_id)
        self._offered: dict[str, ArtifactRef] = {}
        self._published_at = 0.0
        self.chunks_served = 0
        self.chunks_fetched = 0
        self._handler = P2PHandler(dht, HANDLER, self._serve, "artifacts")

    # --- serving -------------------------------------------------------------------------------

    def offer(self, ref: ArtifactRef) -> None:
        if not self.store.has(ref) or self.store.digests(ref.sha256) is None:
            raise ArtifactError(f"cannot offer {ref.name}: it is not complete in {self.store.root}")
        self._offered[ref.sha256] = ref
        self._published_at = 0.0  # publish the new offer at the next `publish`

    async def _serve(self, request: runtime_pb2.Tensor, context: P2PContext) -> runtime_pb2.Tensor:
        reply = b""
        try:
            if len(request.buffer) > MAX_REQUEST_BYTES:
                raise ValueError("request too long")
            asked = json.loads(request.buffer.decode())
            ref = self._offered.get(str(asked.get("sha256")))
            index = asked.get("chunk")
            if ref is not None and asked.get("digests") is True:
                reply = self.store.digests(ref.sha256) or b""
            elif ref is not None and type(index) is int and 0 <= index < ref.n_chunks:
                asker = context.remote_id.to_base58()
                if self.limits.acquire(asker, ref.chunk_length(index), has_standing=False) is not None:
                    return runtime_pb2.Tensor(dtype=BUSY)
                try:
                    reply = await asyncio.to_thread(self.store.read_chunk, ref, index)
                finally:
                    self.limits.release(asker, has_standing=False)
                self.chunks_served += 1
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError, OSError) as e:
            logger.debug(f"artifact request from {context.remote_id}: {type(e).__name__}: {e}")
        return runtime_pb2.Tensor(buffer=reply)

    def publish(
        self, dht: hivemind.DHT, key: RSAPrivateKey, run_name: str, run_id: str, admission: str = ""
    ) -> None:
        """Says in the DHT which artifacts we serve (at most every REPUBLISH_SECONDS), with our
        admission to the run if we have one (nodes keep admitted servers first under a flood)."""
        if not self._offered or time.monotonic() - self._published_at < REPUBLISH_SECONDS:
            return
        record = ArtifactsRecord(
            peer_id=self.peer_id, sha256s=sorted(self._offered)[:16], admission=admission
        )
        if store_record(dht, artifacts_key(run_name, run_id), key, record, ARTIFACTS_TTL_SECONDS):
            self._published_at = time.monotonic()

    # --- fetching ------------------------------------------------------------------------------

    def fetch(self, ref: ArtifactRef, sources: list[str], progress: bool = True) -> Path:
        """The artifact's local path: already here, or fetched from `sources` (peer ids) now."""
        if self.store.has(ref):
            return self.store.path(ref.sha256)
        sources = [s for s in dict.fromkeys(sources) if s != self.peer_id]
        if len(sources) > MAX_SOURCES:
            sources = random.sample(sources, MAX_SOURCES)
        if not sources:
            raise ArtifactError(f"{ref.name} ({ref.sha256[:12]}…): no peer offers it")
        budget = REQUEST_TIMEOUT_SECONDS * (ref.n_chunks + 2) * MAX_SOURCE_FAILURES + 60
        return self._handler.call(self._fetch(ref, sources, progress), budget)

    async def _ask(self, source: str, request: dict, expected_bytes: int) -> bytes:
        message = runtime_pb2.Tensor(buffer=json.dumps(request).encode())
        peer = PeerID.from_base58(source)
        call = self._handler.p2p.call_protobuf_handler(peer, HANDLER, message, runtime_pb2.Tensor)
        answer = await asyncio.wait_for(call, REQUEST_TIMEOUT_SECONDS)
        if answer.dtype == BUSY:
            raise _Busy()
        reply = answer.buffer
        if len(reply) != expected_bytes:
            raise _BadChunk(f"sent {len(reply)} bytes where {expected_bytes} were due")
        return reply

    async def _chunk_list(self, ref: ArtifactRef, sources: list[str], why: dict[str, str]) -> list[bytes]:
        for source in sources:
            try:
                raw = await self._ask(source, {"sha256": ref.sha256, "digests": True}, 32 * ref.n_chunks)
                return ref.check_digests(raw)
            except (_BadChunk, ValueError) as e:
                why[source] = f"bad chunk list ({e})"
            except Exception as e:
                why[source] = f"unreachable ({type(e).__name__})"
        raise ArtifactError(f"{ref.name} ({ref.sha256[:12]}…): no source sent its chunk list: {why}")

    async def _fetch(self, ref: ArtifactRef, sources: list[str], progress: bool) -> Path:
        why: dict[str, str] = {}
        digests = await self._chunk_list(ref, sources, why)
        part, missing = await asyncio.to_thread(self.store.open_partial, ref, digests)
        if missing and len(missing) < ref.n_chunks:
            here = ref.n_chunks - len(missing)
            logger.info(f"{ref.name}: resuming, {here} of {ref.n_chunks} chunks already here")
        queue = deque(missing)
        failures = {s: 0 for s in sources if s not in why}
        busy: dict[str, int] = {}
        have = ref.size_bytes - sum(ref.chunk_length(i) for i in missing)
        bar = tqdm(
            total=ref.size_bytes, initial=have, unit="B", unit_scale=True, desc=ref.name, disable=not progress
        )

        async def worker(source: str) -> None:
            while queue and source in failures:
                index = queue.popleft()
                try:
                    request = {"sha256": ref.sha256, "chunk": index}
                    data = await self._ask(source, request, ref.chunk_length(index))
                    if hashlib.sha256(data).digest() != digests[index]:
                        raise _BadChunk(f"chunk {index} does not match its digest")
                except _Busy:  # over its upload limits: ask again in a moment, a bounded number of times
                    queue.append(index)
                    busy[source] = busy.get(source, 0) + 1
                    if busy[source] > MAX_BUSY_ANSWERS:
                        failures.pop(source, None)
                        why[source] = f"busy {MAX_BUSY_ANSWERS} times"
                        return
                    await asyncio.sleep(BUSY_RETRY_SECONDS)
                    continue
                except _BadChunk as e:
                    queue.append(index)
                    failures.pop(source, None)
                    why[source] = f"dropped: {e}"
                    logger.warning(f"{ref.name}: dropped source {source}: {e}")
                    return
                except Exception as e:
                    queue.append(index)
                    failures[source] += 1
                    if failures[source] >= MAX_SOURCE_FAILURES:
                        failures.pop(source, None)
                        why[source] = f"dropped after {MAX_SOURCE_FAILURES} failures ({type(e).__name__})"
                    continue
                await asyncio.to_thread(self.store.write_chunk, part, ref, index, data)
                self.chunks_fetched += 1
                bar.update(len(data))

        try:
            while queue and failures:
                alive = list(failures)
                await asyncio.gather(*(worker(alive[i % len(alive)]) for i in range(PARALLEL_REQUESTS)))
        finally:
            bar.close()
        if queue:
            raise ArtifactError(
                f"{ref.name} ({ref.sha256[:12]}…): {len(queue)} of {ref.n_chunks} chunks could not be "
                f"fetched; the partial file stays for a resume. Sources: {why}"
            )
        path = await asyncio.to_thread(self.store.complete, part, ref, b"".join(digests))
        log = logger.info if progress else logger.debug  # many small shards: one line each is noise
        log(f"{ref.name}: fetched {ref.size_bytes} bytes, sha256 {ref.sha256[:12]}… verified")
        return path

    def shutdown(self) -> None:
        self._handler.shutdown()


def providers(dht: hivemind.DHT, run_name: str, run_id: str, sha256: str) -> list[str]:
    """Peers that say in the DHT that they serve the artifact `sha256` (claims: each is verified)."""
    records = read_records(dht, artifacts_key(run_name, run_id), ArtifactsRecord)
    return [r.peer_id for r, _ in records if sha256 in r.sha256s]
