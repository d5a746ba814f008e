"""A swarm of up to 64 DHT nodes on loopback: `python -m benchmarks.dht_scale --out DIR [--nodes 16,32,64]`.

Each node is its own light process (benchmarks/dht_scale_node.py): a real pathswarm DHT node that
does a peer's DHT work and nothing else — every 5 s it publishes its signed claim and reads the run's
claim view, as a peer's heartbeat does. Every fourth node is in client mode, as a volunteer behind
NAT would be (it stores and reads but serves no DHT requests). Node 0 is the bootstrap. Nodes start
8 at a time. The `--baseline_nodes` sizes run first with hivemind's DHT defaults (search beams of 20,
every record validated in full each time it arrives: pathswarm before it narrowed its beams and
remembered validations, dht/records.py and dht/validators.py), then the `--nodes` sizes with
pathswarm's. For each swarm size, in one run:

* `convergence_seconds`: from the last node's start until a node's view holds every node's claim
  (max and median over nodes);
* `rpcs_per_node_per_minute`: DHT RPCs each node's DHT process sends (find, store, ping, counted
  inside that process) over a steady minute; every RPC sent is one some node serves, so this is also
  the mean load a node serves;
* `cpu_seconds_per_node_per_minute`, `rss_mib_per_node`, `uss_mib_per_node`: a node's process tree
  (its process, its DHT process, p2pd) over the same minute (psutil; USS = pages only it holds);
* `visible_after_leave_seconds` / `visible_after_kill_seconds`: how long the others still see the
  claim of a node that left (SIGTERM: it publishes a leaving claim) or was killed (SIGKILL: its claim
  expires after `CLAIM_TTL_SECONDS`), one value per (departed node, remaining node).

Writes DIR/dht_scale.json, DIR/dht_scale.md and DIR/dht_scale.png; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.dht_scale_report import HIVEMIND_DEFAULTS, PATHSWARM, row, write_report
from dht.keys import CLAIM_TTL_SECONDS

REPO = Path(__file__).resolve().parents[1]
RUN_NAME = "scale"
RUN_ID = "5c" * 32
BATCH = 8
CLIENT_EVERY = 4  # every fourth node is in client mode
#: memory a node needs at least (one alone: ~180 MiB USS); the guard below uses what the started
#: nodes really took, when that is more
NODE_BUDGET_BYTES = 200 * 2**20
#: memory left free for the rest of the machine whatever the swarm's size
HEADROOM_BYTES = 1536 * 2**20
#: below this much free memory a size is stopped (its nodes' memory grows when the CPU is short)
MIN_FREE_BYTES = 768 * 2**20
#: how long views may take to hold every claim after the last node started
CONVERGE_SECONDS = 120.0
#: hivemind's default (file_system) starts a torch_shm_manager process per node for its futures'
#: shared bytes (~56 MiB of its own); file descriptors need none. A peer pays that process too.
NODE_ENV = {"HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor", "HIVEMIND_SHM_BUFFER_SIZE": "4096"}


class Swarm:
    """The light nodes of one swarm size, in their own process groups, killed on any exit."""

    def __init__(self, n: int, work: Path, heartbeat: float, hivemind_defaults: bool = False):
        self.n, self.work, self.heartbeat = n, work, heartbeat
        self.hivemind_defaults = hivemind_defaults
        self.procs: list[subprocess.Popen] = []
        self.ids: list[str | None] = [None] * n

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            _kill(p, signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def events(self, i: int) -> list[dict]:
        path = self.work / f"events{i}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def counts(self, i: int) -> dict:
        try:
            return json.loads((self.work / f"counts{i}.json").read_text())
        except (OSError, ValueError):
            return {}

    def spawn(self, i: int, initial_peers: list[str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "benchmarks.dht_scale_node", "--index", str(i),
                "--run_name", RUN_NAME, "--run_id", RUN_ID, "--heartbeat_seconds", str(self.heartbeat),
                "--events", str(self.work / f"events{i}.jsonl"),
                "--counts", str(self.work / f"counts{i}.json"),
                "--initial_peers", *initial_peers]  # fmt: skip
        # a starved machine answers slowly: a joiner waits longer than a peer's default 30 s
        argv += ["--startup_timeout_seconds", "120"]
        if self.hivemind_defaults:
            argv.append("--hivemind_defaults")
        if i % CLIENT_EVERY == CLIENT_EVERY - 1:
            argv.append("--client_mode")
        else:  # a server node: later joiners may start from it, as a real swarm's list several peers
            argv += ["--address_file", str(self.work / ("bootstrap.json" if i == 0 else f"address{i}.json"))]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **NODE_ENV,
        }
        log = open(self.work / f"node{i}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        log.close()
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 300.0) -> float:
        """Starts every node; returns the wall time at which the last one had started."""
        self.spawn(0, [])
        bootstrap = _wait(
            lambda: _read_json(self.work / "bootstrap.json"), timeout, "the bootstrap's address"
        )
        free_before = psutil.virtual_memory().available
        for first in range(1, self.n, BATCH):
            free = psutil.virtual_memory().available
            per_node = max(NODE_BUDGET_BYTES, (free_before - free) / first)
            batch = min(BATCH, self.n - first)
            if free < batch * per_node + HEADROOM_BYTES:
                raise MemoryError(
                    f"{first} nodes started, {per_node / 2**20:.0f} MiB each; {free / 2**30:.1f} GiB left "
                    f"is too little for {batch} more"
                )
            servers = [a for j in range(1, first) if (a := _read_json(self.work / f"address{j}.json"))]
            for i in range(first, min(self.n, first + BATCH)):
                # the bootstrap and up to 3 earlier server nodes: the load of joins is spread
                extra = [servers[(i + k) % len(servers)][0] for k in range(min(3, len(servers)))]
                self.spawn(i, [*bootstrap, *dict.fromkeys(extra)])
            upto = min(self.n, first + BATCH)
            _wait(
                lambda upto=upto: all(self._started(i) for i in range(upto)), timeout, f"nodes up to {upto}"
            )
        return max(self._started(i) for i in range(self.n))

    def _started(self, i: int) -> float | None:
        for e in self.events(i):
            if "started" in e:
                self.ids[i] = e["started"]
                return e["t"]
        if self.procs[i].poll() is not None:
            raise RuntimeError(f"node {i} exited: {(self.work / f'node{i}.log').read_text()[-2000:]}")
        return None


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait(check, timeout: float, what: str, fatal: bool = True):
    """Polls `check` until it is true; past `timeout`, raises (or returns None when not `fatal`).
    Stops the swarm's size with MemoryError when the machine runs short (the nodes grow under load)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if psutil.virtual_memory().available < MIN_FREE_BYTES:
            raise MemoryError(f"less than {MIN_FREE_BYTES / 2**30:.1f} GiB free while waiting for {what}")
        time.sleep(0.5)
    if fatal:
        raise TimeoutError(f"waited {timeout:.0f}s for {what}")
    return None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _memory(pid: int) -> tuple[float, float]:
    rss = uss = 0.0
    for p in _tree(pid):
        try:
            info = p.memory_full_info()
            rss, uss = rss + info.rss, uss + info.uss
        except psutil.NoSuchProcess:
            pass
    return rss / 2**20, uss / 2**20


def _converged_at(events: list[dict], ids: set[str]) -> float | None:
    for e in events:
        if "seen" in e and ids <= set(e["seen"]):
            return e["t"]
    return None


def _best_view(events: list[dict], ids: set[str]) -> float:
    return max((len(ids & set(e["seen"])) / len(ids) for e in events if "seen" in e), default=0.0)


def _gone_after(events: list[dict], departed: str, since: float) -> float | None:
    for e in events:
        if "seen" in e and e["t"] >= since and departed not in e["seen"]:
            return e["t"] - since
    return None


def run_size(
    n: int,
    work: Path,
    heartbeat: float = 5.0,
    steady_seconds: float = 60.0,
    departures: int = 2,
    hivemind_defaults: bool = False,
    kill_watch_seconds: float | None = None,
) -> dict:
    """One swarm of `n` nodes: convergence, a steady window, then departures; see the module docstring.
    `kill_watch_seconds`: stop watching the killed nodes' claims then (None: until their TTL ran out)."""
    work.mkdir(parents=True, exist_ok=True)
    with Swarm(n, work, heartbeat, hivemind_defaults) as swarm:
        all_started = swarm.start()
        ids = set(swarm.ids)
        # a machine too small for the swarm shows as views that never hold every claim: recorded, not fatal
        _wait(
            lambda: all(_converged_at(swarm.events(i), ids) for i in range(n)),
            CONVERGE_SECONDS,
            "every view to converge",
            fatal=False,
        )
        at = [_converged_at(swarm.events(i), ids) for i in range(n)]
        convergence = [t - all_started for t in at if t is not None]
        coverage = [_best_view(swarm.events(i), ids) for i in range(n)]
        # the steady window: RPCs, CPU and memory per node
        counts0 = [swarm.counts(i) for i in range(n)]
        cpu0 = [_cpu_seconds(p.pid) for p in swarm.procs]
        t0 = time.time()
        psutil.cpu_percent()  # starts the machine's busy-time window
        _wait(lambda: time.time() - t0 >= steady_seconds, steady_seconds + 5, "the steady window")
        machine_busy = psutil.cpu_percent() / 100
        minutes = (time.time() - t0) / 60
        counts1 = [swarm.counts(i) for i in range(n)]
        cpu1 = [_cpu_seconds(p.pid) for p in swarm.procs]
        memory = [_memory(p.pid) for p in swarm.procs]
        free_at_steady = psutil.virtual_memory().available
        kinds = ("call_find", "call_store", "call_ping")
        rpcs = [
            sum(c1.get(k, 0) - c0.get(k, 0) for k in kinds) / minutes
            for c0, c1 in zip(counts0, counts1, strict=True)
        ]
        by_kind = {
            k: statistics.mean(
                (c1.get(k, 0) - c0.get(k, 0)) / minutes for c0, c1 in zip(counts0, counts1, strict=True)
            )
            for k in kinds
        }
        # departures: the first `departures` non-bootstrap nodes leave, the next ones are killed
        leavers, killed = list(range(1, 1 + departures)), list(range(1 + departures, 1 + 2 * departures))
        since = time.time()
        for i in leavers:
            _kill_main(swarm.procs[i], signal.SIGTERM)
        for i in killed:
            _kill(swarm.procs[i], signal.SIGKILL)
        remaining = [i for i in range(n) if i not in leavers + killed]
        deadline = CLAIM_TTL_SECONDS + 3 * heartbeat + 15

        def gone(group: list[int]) -> list[float | None]:
            return [_gone_after(swarm.events(r), swarm.ids[d], since) for d in group for r in remaining]

        def over() -> bool:
            watched = kill_watch_seconds is not None and time.time() - since > kill_watch_seconds
            return all(v is not None for v in gone(leavers if watched else leavers + killed))

        _wait(
            over,
            deadline,
            "departed claims to vanish",
            fatal=False,
        )
        reads = [e["seconds"] for i in range(n) for e in swarm.events(i) if "seen" in e and t0 <= e["t"]]
        left, dead = gone(leavers), gone(killed)
    return dict(
        nodes=n,
        dht_settings=HIVEMIND_DEFAULTS if hivemind_defaults else PATHSWARM,
        client_nodes=sum(1 for i in range(1, n) if i % CLIENT_EVERY == CLIENT_EVERY - 1),
        converged_nodes=len(convergence),
        convergence_seconds_max=max(convergence) if len(convergence) == n else None,
        convergence_seconds_median=statistics.median(convergence) if convergence else None,
        convergence_seconds=convergence,
        #: per node, the largest share of the swarm's claims one of its reads held
        view_coverage_min=min(coverage),
        view_coverage_median=statistics.median(coverage),
        #: one heartbeat's publish + read, from the steady window on (5 s heartbeat: under 5 s or late)
        heartbeat_work_seconds_median=statistics.median(reads) if reads else None,
        heartbeat_work_seconds_p90=statistics.quantiles(reads, n=10)[-1] if len(reads) > 1 else None,
        rpcs_per_node_per_minute=statistics.mean(rpcs),
        rpcs_per_node_per_minute_max=max(rpcs),
        rpcs_by_kind_per_node_per_minute=by_kind,
        cpu_seconds_per_node_per_minute=statistics.mean(
            (b - a) / minutes for a, b in zip(cpu0, cpu1, strict=True)
        ),
        rss_mib_per_node=statistics.mean(m[0] for m in memory),
        uss_mib_per_node=statistics.mean(m[1] for m in memory),
        machine_cpu_busy_fraction=machine_busy,
        memory_available_gib=free_at_steady / 2**30,
        visible_after_leave_seconds=[v for v in left if v is not None],
        visible_after_kill_seconds=[v for v in dead if v is not None],
        #: (departed, observer) pairs still seeing the claim when the wait ended
        still_visible_at_deadline=sum(v is None for v in left + dead),
        #: (killed, observer) pairs still seeing the claim when the wait ended
        killed_still_visible=sum(v is None for v in dead),
        claim_ttl_seconds=CLAIM_TTL_SECONDS,
        heartbeat_seconds=heartbeat,
    )


def _kill_main(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dht_scale", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nodes", default="16,32,64", help="swarm sizes, one after another")
    p.add_argument("--heartbeat_seconds", type=float, default=5.0)
    p.add_argument("--steady_seconds", type=float, default=60.0)
    p.add_argument(
        "--baseline_nodes",
        default="16,32",
        help="sizes also run with hivemind's DHT defaults (beams of 20, no remembered validations), "
        "first; '' for none",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {s}")))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sizes = []
    with tempfile.TemporaryDirectory(prefix="pathswarm-dht-scale-", ignore_cleanup_errors=True) as work:
        plan = [(int(x), True) for x in args.baseline_nodes.split(",") if x.strip()]
        plan += [(int(x), False) for x in args.nodes.split(",")]
        stopped: set[bool] = set()
        for n, defaults in plan:
            if defaults in stopped:
                continue
            settings = HIVEMIND_DEFAULTS if defaults else PATHSWARM
            print(f"{n} nodes, {settings} ...", flush=True)
            try:
                sizes.append(
                    run_size(
                        n,
                        Path(work) / f"{n}-{int(defaults)}",
                        args.heartbeat_seconds,
                        args.steady_seconds,
                        hivemind_defaults=defaults,
                    )  # fmt: skip
                )
            # the machine's limit (memory, a node that could not join): in the report, and no bigger
            # size with the same settings
            except (MemoryError, TimeoutError, RuntimeError) as e:
                sizes.append({"nodes": n, "dht_settings": settings, "error": str(e)})
                stopped.add(defaults)
            print(row(sizes[-1]), flush=True)
    result = dict(
        sizes=sizes,
        wall_seconds=time.monotonic() - started,
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            memory_gib=psutil.virtual_memory().total / 2**30,
        ),
        command=" ".join(["python -m benchmarks.dht_scale", *(argv if argv is not None else sys.argv[1:])]),
    )
    (args.out / "dht_scale.json").write_text(json.dumps(result, indent=2))
    print(write_report(result, args.out))
    print(f"wrote {args.out}/dht_scale.json, dht_scale.md, dht_scale.png in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
