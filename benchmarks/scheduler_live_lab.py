"""The two-region WAN of `benchmarks.scheduler_live`: who is in which region, what each link carries,
and what the peers are told about it.

Every peer is a namespace of benchmarks/wan/netlab.py. Its egress is an `htb` tree of two classes:
`--fast_mbit` to the peers of its own region and `--slow_mbit` to the others (a `u32` filter per
far address; `tbf` alone caps a host's whole egress, and `netem` is not on this kernel). A region
change (`Regions.swap`) rewrites the filters of every host at once, as if two volunteers' routes had
changed. The peers learn the links from a probe file (`--probe_file`, replaced atomically on each
change) that states exactly the lab's rates: probing 1 MiB over the slow link would take seconds
per pair and per cycle. Latency is not emulated (no netem): the file says `--latency_ms` inside a
region and `--far_latency_ms` across, and only the planner sees it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.wan.netlab import Host, NetLab


class Regions:
    """Region of each peer host, its htb shaping, and the probe file that describes it."""

    def __init__(self, lab: NetLab, hosts: list[Host], region: list[int], args, probe_file: Path):
        self.lab, self.hosts, self.region = lab, hosts, list(region)
        self.fast_mbit, self.slow_mbit = args.fast_mbit, args.slow_mbit
        self.latency = (args.latency_ms / 1000, args.far_latency_ms / 1000)
        self.probe_file = probe_file
        self.peer_ids: list[str] = []
        self.tokens_per_second: list[float] = []
        #: (unix time, regions from then on): which groups crossed regions when
        self.changes: list[tuple[float, list[int]]] = []

    def shape(self) -> None:
        """(Re)builds every host's egress tree for the current regions."""
        self.changes.append((time.time(), list(self.region)))
        for i, h in enumerate(self.hosts):
            self.lab.ns(h, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            self.lab.ns(
                h, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10"
            )
            for classid, mbit in (("1:10", self.fast_mbit), ("1:20", self.slow_mbit)):
                self.lab.ns(h, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", classid,
                            "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")  # fmt: skip
            for j, other in enumerate(self.hosts):
                if self.region[j] != self.region[i]:
                    far = ("u32", "match", "ip", "dst", f"{other.ip}/32", "flowid", "1:20")
                    self.lab.ns(h, "tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                                "prio", "1", *far)  # fmt: skip

    def link(self, i: int, j: int, region: list[int] | tuple[int, ...] | None = None) -> list[float]:
        """[latency s, bandwidth B/s] from peer i to peer j, as the lab shapes it (under `region`,
        a past or future assignment of regions, if given)."""
        region = self.region if region is None else region
        near = region[i] == region[j]
        mbit = self.fast_mbit if near else self.slow_mbit
        return [self.latency[0] if near else self.latency[1], mbit * 1e6 / 8]

    def write_probe_file(self) -> None:
        ids = self.peer_ids
        data = {
            "tokens_per_second": dict(zip(ids, self.tokens_per_second, strict=True)),
            "links": {
                a: {b: self.link(i, j) for j, b in enumerate(ids) if j != i} for i, a in enumerate(ids)
            },
        }
        tmp = self.probe_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.probe_file)  # a peer never reads half a file

    def swap(self, a: int, b: int) -> None:
        """Peers a and b trade regions: the lab's routes and the probe file change together."""
        self.region[a], self.region[b] = self.region[b], self.region[a]
        self.shape()
        self.write_probe_file()

    def cross_region(self, members: list[str], at: float) -> bool:
        """Whether a group of `members` at unix time `at` spanned both regions."""
        region = next((r for t, r in reversed(self.changes) if t <= at), self.changes[0][1])
        return len({region[self.peer_ids.index(p)] for p in members if p in self.peer_ids}) > 1
