"""The askers of `benchmarks.serve_flood`: fresh keys that ask one holder for a module's whole state,
again and again, as fast as it answers.

Each asker is a DHT node of its own (a libp2p identity made a moment before: what a key costs a real
attacker) with a `SyncService`, so the holder sees `--askers` different peers none of which has
standing in the run. Every asker keeps `--requests_at_once` downloads of the module's whole state
going; a refusal ("busy: ...") or a failure is counted by its reason and asked again at once. With
`--other_run` its requests name another run, which the holder refuses before anything else: the
cost of answering alone. At the
end it writes `--out` (JSON): the bytes and states it received in each second, and the refusals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from dht.node import start_dht
from peer.codecs.formats import make_codec
from peer.run.record import load_record, verify_record
from peer.swarm.keeper import state_numels
from peer.sync.inbox import Inbox
from peer.sync.service import SyncService
from peer.sync.state_transfer import download_range
from peer.sync.wire import WireError

#: a download is given this long before the asker counts it failed and asks again
REQUEST_TIMEOUT_SECONDS = 30.0


_TALLY_LOCK = threading.Lock()  # every asker's service runs on a loop thread of its own


def _count(tally: dict, kind: str, what, n: int = 1) -> None:
    with _TALLY_LOCK:
        tally[kind][what] += n


async def _ask_forever(service: SyncService, holder: str, module: str, numels: list[int], end: float, tally):
    """Downloads of the whole state until `end` (monotonic); what each got goes into `tally`."""
    total = sum(numels)
    while time.monotonic() < end:
        try:
            await download_range(service, holder, module, numels, 0, total, REQUEST_TIMEOUT_SECONDS)
            second = int(time.time())
            _count(tally, "bytes_by_second", second, 4 * total)
            _count(tally, "states_by_second", second)
        except WireError as e:  # the holder's answer: "<holder> refused: busy: ..." and the like
            reason = str(e).split("refused: ", 1)[-1]
            _count(
                tally, "refused", re.sub(r"[0-9][0-9.]*", "N", reason)[:80]
            )  # one tally per kind of refusal
            await asyncio.sleep(0)  # asked again at once, as an attacker would
        except Exception as e:
            _count(tally, "failed", type(e).__name__)
            await asyncio.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--initial_peers", nargs="+", required=True)
    p.add_argument("--manifest_path", type=Path, required=True)
    p.add_argument("--holder", required=True, help="peer id of the holder asked")
    p.add_argument("--module", default="trunk")
    p.add_argument("--askers", type=int, default=4)
    p.add_argument("--requests_at_once", type=int, default=2, help="per asker")
    p.add_argument(
        "--other_run", action="store_true", help="ask as peers of another run: every request refused at once"
    )
    p.add_argument("--go_file", type=Path, required=True, help="asking starts once this file exists")
    p.add_argument("--seconds", type=float, required=True, help="how long to ask")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    record = load_record(args.manifest_path)
    manifest = verify_record(record)
    numels = state_numels(manifest, args.module)
    nodes, services, started = [], [], None
    tally = {
        "bytes_by_second": Counter(),
        "states_by_second": Counter(),
        "refused": Counter(),
        "failed": Counter(),
    }
    try:
        for _ in range(args.askers):  # each a fresh identity: a peer without standing to the holder
            dht, key = start_dht(initial_peers=args.initial_peers, client_mode=True)
            nodes.append(dht)
            inbox = Inbox({}, make_codec(manifest.sync.codec), lambda p, m: False, 1, 0.0)
            run_id = "0" * 64 if args.other_run else record.run_id
            services.append(SyncService(dht, run_id, inbox, REQUEST_TIMEOUT_SECONDS, key=key))
        print(f"askers ready: {len(services)}", flush=True)
        while not args.go_file.exists():  # the benchmark's window before the flood runs meanwhile
            time.sleep(0.05)
        started = time.time()
        end = time.monotonic() + args.seconds
        futures = [
            s.submit(_ask_forever(s, args.holder, args.module, numels, end, tally))
            for s in services
            for _ in range(args.requests_at_once)
        ]
        for f in futures:
            f.result(timeout=args.seconds + 2 * REQUEST_TIMEOUT_SECONDS)
    except KeyboardInterrupt:
        pass
    finally:
        out = {
            "askers": args.askers, "requests_at_once": args.requests_at_once, "module": args.module,
            "other_run": args.other_run,
            "state_bytes": 4 * sum(numels), "started": started, "seconds": args.seconds,
            **{k: {str(s): n for s, n in sorted(v.items())} for k, v in tally.items()},
        }  # fmt: skip
        args.out.write_text(json.dumps(out, indent=1))
        for s in services:
            s.shutdown()
        for dht in nodes:
            dht.shutdown()


if __name__ == "__main__":
    main()
