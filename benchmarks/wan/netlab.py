"""An emulated WAN on one machine: network namespaces on a bridge, capped egress, optional loss.

`NetLab(n)` makes n namespaces `psw-<tag>-<i>` (tag = a short per-run suffix, so parallel runs do
not clash), each joined to the bridge `psw-<tag>-br` by a veth pair and given one address on a
private /24 that exists only on this bridge: the namespaces have no default route and the host no
address there, so traffic can only go from one namespace to another. Each namespace's egress is
capped with `tc tbf` on its own end of the veth (`netem` is not available on this kernel), and
random loss is an iptables `statistic` rule on that interface. Bytes on the wire come from the
host end of each veth (`/sys/class/net/<veth>/statistics`): what the host end receives is what
the namespace sent.

Processes are started with `ip netns exec` in their own session/process group and killed by group.
A host's training thread can be given a CPU quota (`limit_thread_cpu`, a cgroup v1 `cpu` group
of the host's own): several emulated machines share this box's cores, and the quota plays each
one's accelerator, a fixed compute budget that its networking does not eat into. Leaving the
context manager (also on an exception or KeyboardInterrupt) kills the processes and deletes every
namespace, veth, bridge and cgroup the lab made, by name. Needs root; `can_make_namespaces()` says
whether this machine allows it, so callers can skip instead of failing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: seconds between two readings of every host's veth counters
SAMPLE_SECONDS = 0.2
PREFIX = "psw-"
# cgroup v1 cpu controller: it takes single threads (v2 needs threaded subtrees), so a peer's training
# thread can get a CPU quota while its networking threads run outside it
CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")


class NetLabError(RuntimeError):
    """A namespace, link or qdisc could not be made; the lab has already cleaned up after itself."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetLabError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _new_tag() -> str:
    # pid in the tag lets a later run see whether the lab's owner is still alive (`stale_tags`)
    return f"{os.getpid():x}{secrets.token_hex(1)}"[-7:]


def ensure_tools(install: bool = False) -> list[str]:
    """The tools this lab uses that are missing (after trying to install them with apt as root, when
    `install`: the benchmark does; tests never install anything, `.ci/run` does it beforehand)."""
    wanted = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}
    missing = [tool for tool in wanted if shutil.which(tool) is None]
    if missing and install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
        packages = sorted({wanted[t] for t in missing})
        subprocess.run(["apt-get", "install", "-y", "-qq", *packages], capture_output=True, env=env)
        missing = [tool for tool in wanted if shutil.which(tool) is None]
    return missing


def can_make_namespaces(install: bool = False) -> tuple[bool, str]:
    """(True, "") if a namespace, a veth pair and a bridge can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    missing = [t for t in ensure_tools(install) if t in ("ip", "tc")]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (install iproute2)"
    tag = _new_tag()
    ns, br, veth = f"{PREFIX}{tag}-probe", f"{PREFIX}{tag}-pb", f"{PREFIX}{tag}-pv"
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", br, "type", "bridge")
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
             "rate", "10mbit", "burst", "32kb", "latency", "50ms")  # fmt: skip
    except (NetLabError, OSError) as e:
        return False, str(e)
    finally:
        _run("ip", "link", "del", veth, check=False)
        _run("ip", "link", "del", br, check=False)
        _run("ip", "netns", "del", ns, check=False)
    return True, ""


def lab_namespaces(tag: str | None = None) -> list[str]:
    """Namespaces named like a lab's (all labs', or the one with `tag`)."""
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    want = f"{PREFIX}{tag}-" if tag else PREFIX
    return [n for n in names if n.startswith(want)]


def lab_links(tag: str | None = None) -> list[str]:
    """Links in the host namespace named like a lab's."""
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    want = f"{PREFIX}{tag}-" if tag else PREFIX
    return [n for n in names if n.startswith(want)]


def stale_tags() -> list[str]:
    """Tags of labs whose owner process is gone (a SIGKILLed run): safe to `remove_tag`."""
    tags = {name[len(PREFIX) :].split("-")[0] for name in lab_namespaces() + lab_links()}
    stale = []
    for tag in tags:
        try:
            pid = int(tag[:-2], 16)
        except ValueError:
            continue
        if pid <= 0 or not Path(f"/proc/{pid}").exists():
            stale.append(tag)
    return sorted(stale)


def lab_cgroups(tag: str | None = None) -> list[Path]:
    """CPU cgroups named like a lab's."""
    want = f"{PREFIX}{tag}-" if tag else PREFIX
    if not CPU_CGROUP_ROOT.is_dir():
        return []
    return sorted(p for p in CPU_CGROUP_ROOT.iterdir() if p.is_dir() and p.name.startswith(want))


def can_limit_threads() -> bool:
    return os.geteuid() == 0 and (CPU_CGROUP_ROOT / "tasks").exists()


def remove_tag(tag: str) -> None:
    """Deletes every namespace, host link and CPU cgroup of the lab `tag`, by name."""
    for ns in lab_namespaces(tag):
        _run("ip", "netns", "del", ns, check=False)  # also destroys the veth pairs inside
    for link in lab_links(tag):
        _run("ip", "link", "del", link, check=False)
    for group in lab_cgroups(tag):
        remove_cpu_cgroup(group)


def remove_cpu_cgroup(group: Path) -> None:
    """Moves the threads still in `group` back to the root group and deletes it (quietly: cleanup)."""
    try:
        for tid in (group / "tasks").read_text().split():  # threads still inside go back to the root
            try:
                (CPU_CGROUP_ROOT / "tasks").write_text(tid)
            except OSError:
                pass
        group.rmdir()
    except OSError:
        pass


@dataclass
class Host:
    """One namespace of the lab and its link to the bridge."""

    index: int
    netns: str
    ip: str
    host_veth: str  # the end on the bridge, in the host namespace
    cap_mbit: float | None
    loss: float

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.ip}/tcp/{port}"


class NetLab:
    """`with NetLab(n, cap_mbit=20) as lab:` n namespaces on one bridge, torn down on exit."""

    def __init__(
        self,
        n_hosts: int,
        cap_mbit: float | Sequence[float | None] | None = None,
        loss: float | Sequence[float] = 0.0,
        tag: str | None = None,
    ):
        if n_hosts < 1 or n_hosts > 200:
            raise ValueError("a lab has 1..200 hosts")
        caps = list(cap_mbit) if isinstance(cap_mbit, Sequence) else [cap_mbit] * n_hosts
        losses = list(loss) if isinstance(loss, Sequence) else [loss] * n_hosts
        if len(caps) != n_hosts or len(losses) != n_hosts:
            raise ValueError("give one cap and one loss per host, or a single value for all")
        if any(not 0 <= p < 1 for p in losses):
            raise ValueError("loss is a probability in [0, 1)")
        self.tag = tag or _new_tag()
        self.bridge = f"{PREFIX}{self.tag}-br"
        # a /24 that exists only on this bridge; varies per lab only to keep logs unambiguous
        subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
        self.hosts = [
            Host(i, f"{PREFIX}{self.tag}-{i}", f"{subnet}.{i + 1}", f"{PREFIX}{self.tag}-h{i}", c, p)
            for i, (c, p) in enumerate(zip(caps, losses, strict=True))
        ]
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[Path] = []
        self._made = False

    # --- setup and teardown ---------------------------------------------------------------------

    def __enter__(self) -> NetLab:
        self._made = True
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        if os.geteuid() != 0:
            raise NetLabError("network namespaces need root")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.netns)
            _run("ip", "link", "add", h.host_veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _run("ip", "link", "set", h.host_veth, "master", self.bridge)
            _run("ip", "link", "set", h.host_veth, "up")
            self.ns(h, "ip", "link", "set", "lo", "up")
            self.ns(h, "ip", "addr", "add", f"{h.ip}/24", "dev", "eth0")
            self.ns(h, "ip", "link", "set", "eth0", "up")
            if h.cap_mbit:
                self.set_cap(h, h.cap_mbit)
            if h.loss > 0:
                self.set_loss(h, h.loss)

    def set_cap(self, host: Host, mbit: float | None) -> None:
        """Caps the host's egress at `mbit` (None removes the cap)."""
        self.ns(host, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        host.cap_mbit = mbit
        if not mbit:
            return
        rate_bytes = mbit * 1e6 / 8
        # A bucket of ~5 ms of traffic (at least a few full packets) keeps the rate smooth; a queue of
        # ~200 ms worth lets TCP fill the pipe without tail drops at every burst.
        burst = max(16 * 1024, int(rate_bytes * 0.005))
        self.ns(host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")  # fmt: skip

    def set_ingress_cap(self, host: Host, mbit: float) -> None:
        """Caps what the host receives (its downlink) at `mbit`: tbf on the bridge's end of its veth."""
        rate_bytes = mbit * 1e6 / 8
        _run("tc", "qdisc", "replace", "dev", host.host_veth, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(max(16 * 1024, int(rate_bytes * 0.005))), "latency", "200ms")  # fmt: skip

    def set_loss(self, host: Host, probability: float) -> None:
        """Drops each packet the host sends with this probability (iptables statistic match)."""
        if shutil.which("iptables") is None:
            raise NetLabError("iptables is missing (Debian package iptables)")
        self.ns(host, "iptables", "-F", "OUTPUT")
        host.loss = probability
        if probability > 0:
            self.ns(host, "iptables", "-A", "OUTPUT", "-o", "eth0", "-m", "statistic",
                    "--mode", "random", "--probability", f"{probability:.6f}", "-j", "DROP")  # fmt: skip

    def limit_thread_cpu(self, host: Host, tid: int, cores: float) -> None:
        """Caps one thread (e.g. a peer's training thread) at `cores` CPUs, in a cgroup of the host's
        own; the host's other threads are not limited. Needs the cgroup v1 cpu controller."""
        if not can_limit_threads():
            raise NetLabError(f"no cgroup v1 cpu controller at {CPU_CGROUP_ROOT} (or not root)")
        group = CPU_CGROUP_ROOT / f"{host.netns}-cpu"
        if group not in self.cgroups:
            group.mkdir(exist_ok=True)
            self.cgroups.append(group)
            period = int((group / "cpu.cfs_period_us").read_text())
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(cores * period))))
        (group / "tasks").write_text(str(tid))

    def set_link(self, host: Host, up: bool) -> None:
        """A partition: the host's link to the bridge goes down (or back up)."""
        _run("ip", "link", "set", host.host_veth, "up" if up else "down")

    def close(self) -> None:
        """Kills every process the lab started, then deletes its namespaces, veths and bridge."""
        if not self._made:
            return
        self.kill_all()
        for h in self.hosts:
            _run("ip", "netns", "del", h.netns, check=False)
            _run("ip", "link", "del", h.host_veth, check=False)  # gone with its namespace peer, normally
        _run("ip", "link", "del", self.bridge, check=False)
        for group in self.cgroups:
            remove_cpu_cgroup(group)
        self.cgroups = []
        remove_tag(self.tag)  # anything else named after this lab (a half-made setup)
        self._made = False

    # --- processes and counters -----------------------------------------------------------------

    def ns(self, host: Host, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", host.netns, *args, check=check)

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Starts `argv` inside the host's namespace in a new process group (its children too)."""
        log = open(log_path, "w") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if log_path is not None:
                log.close()
        self.procs.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen], grace_seconds: float = 20.0) -> None:
        """SIGTERM to each main process (so it can checkpoint), then SIGKILL to the whole group."""
        for p in procs:
            if p.poll() is None:
                _signal(p.pid, signal.SIGTERM, group=False)
        deadline = time.monotonic() + grace_seconds
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _signal(p.pid, signal.SIGKILL, group=True)  # children (DHT, averagers, p2pd) too
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def kill_all(self) -> None:
        for p in self.procs:
            _signal(p.pid, signal.SIGKILL, group=True)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def counters(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) by each host so far, read at the host end of its veth."""
        out = []
        for h in self.hosts:
            base = Path("/sys/class/net") / h.host_veth / "statistics"
            # the host end receives what the namespace transmits, and the other way round
            out.append((int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())))
        return out


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Sampler(threading.Thread):
    """Reads every host's veth counters every SAMPLE_SECONDS: (time, [(tx, rx) per host])."""

    def __init__(self, lab: NetLab):
        super().__init__(daemon=True)
        self.lab = lab
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.time(), self.lab.counters()))
            self.stopped.wait(SAMPLE_SECONDS)
        self.samples.append((time.time(), self.lab.counters()))
