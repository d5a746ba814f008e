"""CPU accounting and placement of the WAN lab's peers: a quota for each peer's training thread,
priority for its networking, and CPU seconds of both.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from benchmarks.wan.netlab import CPU_CGROUP_ROOT, Host, NetLab

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class PeerCpu(threading.Thread):
    """How a peer's CPU is shared, the same for every configuration, and what it was spent on.

    Four peers share two cores here. Each peer's training thread (its main thread) gets a CPU quota,
    `--compute_cores` (netlab's per-host cgroup): it plays the peer's accelerator, a fixed compute
    budget. Everything else in the peer's process group (DHT and averager processes, p2pd, helper
    threads) runs outside the quota and `--comm_priority` nice levels above the training threads:
    on a real peer the accelerator computes while the CPU talks, whereas here a peer's compute
    would otherwise starve its own networking (RPCs time out, groups split) and every byte of
    communication would be paid for in compute. CPU seconds are recorded per thread."""

    def __init__(self, lab: NetLab, leaders: dict[int, Host], cores: float | None, boost: int):
        super().__init__(daemon=True)
        self.lab, self.hosts, self.cores = lab, leaders, cores
        self.leaders = set(leaders)
        self.train_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.comm_nice = max(-20, self.train_nice - boost)
        self.stopped = threading.Event()
        self.limited: set[int] = set()
        # CPU seconds last seen per (leader, pid, tid): what compute and communication cost
        self.cpu: dict[tuple[int, int, int], float] = {}
        # involuntary context switches of each training thread: how often another thread preempted
        # it (each costs it its caches; session 55: the p2p daemon's wake-ups, most of them)
        self.preempted: dict[int, int] = {}
        self.names: dict[int, str] = {}
        # the whole machine's CPU times at the start and at the last sample: what the host (another
        # tenant of the VM's cores: steal) and processes outside the lab took from the peers' cores
        self.host_first: dict[str, float] | None = None
        self.host_last: dict[str, float] | None = None

    def run(self) -> None:
        self.host_first = host_cpu_times()
        while True:
            self.host_last = host_cpu_times()
            for pid, leader in _group_members(self.leaders):
                for tid in _threads(pid):
                    try:
                        self._place(tid)
                        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue  # the thread ended meanwhile
                    self.cpu[(leader, pid, tid)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
                    if tid in self.leaders:
                        self.preempted[tid] = _involuntary_switches(pid, tid, self.preempted.get(tid, 0))
                    if pid not in self.names:
                        self.names[pid] = _process_name(pid)
            if self.stopped.wait(0.5):
                return

    def _place(self, tid: int) -> None:
        training = tid in self.leaders
        target = self.train_nice if training else self.comm_nice
        if os.getpriority(os.PRIO_PROCESS, tid) != target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        if not self.cores:
            return
        if training and tid not in self.limited:
            self.lab.limit_thread_cpu(self.hosts[tid], tid, self.cores)
            self.limited.add(tid)
        elif not training and "/psw-" in _cpu_cgroup(tid):
            # threads and processes started by a training thread inherit its cgroup: not theirs
            (CPU_CGROUP_ROOT / "tasks").write_text(str(tid))

    def cpu_seconds(self) -> dict:
        """CPU seconds of the training threads and of everything else (networking), per peer."""
        compute = sum(v for (_, _, tid), v in self.cpu.items() if tid in self.leaders)
        comm = sum(v for (_, _, tid), v in self.cpu.items() if tid not in self.leaders)
        n = max(1, len(self.leaders))
        by_process: dict[str, float] = {}
        for (leader, pid, tid), v in self.cpu.items():
            name = "training thread" if tid in self.leaders else self.names.get(pid, "?")
            name = "peer main process (other threads)" if pid == leader and tid != leader else name
            by_process[name] = by_process.get(name, 0.0) + v / n
        return dict(
            compute_cpu_seconds_per_peer=compute / n,
            comm_cpu_seconds_per_peer=comm / n,
            cpu_seconds_per_peer_by_process=by_process,
            training_thread_preemptions_per_peer=sum(self.preempted.values()) / n,
            **host_share(self.host_first, self.host_last, compute + comm),
        )


def host_cpu_times(stat: str | None = None) -> dict[str, float]:
    """The machine's busy and steal CPU seconds since boot, all cores, from /proc/stat's first line."""
    line = (stat if stat is not None else Path("/proc/stat").read_text()).splitlines()[0]
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice, already within user, nice]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in line.split()[1:9])
    return dict(
        busy_seconds=(user + nice + system + irq + softirq) / CLOCK_TICKS, steal_seconds=steal / CLOCK_TICKS
    )


def host_share(first: dict | None, last: dict | None, peers_cpu_seconds: float) -> dict[str, float]:
    """Over a run: the CPU the hypervisor gave others (steal) and what the machine spent beyond the
    peers' processes (the lab's own sampling, other processes), in seconds; empty where unsampled."""
    if not first or not last:
        return {}
    busy = last["busy_seconds"] - first["busy_seconds"]
    return dict(
        host_steal_seconds=last["steal_seconds"] - first["steal_seconds"],
        host_cpu_seconds_outside_peers=max(0.0, busy - peers_cpu_seconds),
    )


def _involuntary_switches(pid: int, tid: int, last: int) -> int:
    """The thread's nonvoluntary_ctxt_switches so far (`last` where it cannot be read now)."""
    try:
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return last


def _cpu_cgroup(tid: int) -> str:
    for line in Path(f"/proc/{tid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


def _group_members(groups: set[int]) -> list[tuple[int, int]]:
    """(pid, process group) of every process in one of these groups."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in groups:  # field 5 of stat: the process group
            out.append((int(entry.name), int(fields[2])))
    return out


def _process_name(pid: int) -> str:
    """ "p2pd", or the Python process's role from its title/command line."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return comm if "python" not in comm else (cmdline.split()[0] if cmdline else comm)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
