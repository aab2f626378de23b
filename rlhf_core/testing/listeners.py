"""Which sockets a tree of processes listens on, sampled while it runs: the tests that start
whole runs check that nothing of the project's listens beyond loopback."""
from __future__ import annotations

import ipaddress
import threading

import psutil


def loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also written as IPv4 in IPv6 (`::ffff:127.0.0.1`, how a server
    listening on IPv6 sockets shows a loopback-only bind)."""
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


class Listeners(threading.Thread):
    """Every listening TCP socket of the processes under `roots` (their descendants included:
    Ray's daemons and workers, the served model), sampled every 0.3 s until `stop()`.

    A process is named by the longest command line any sample read: one first sampled while it
    exits reads as empty (the kernel frees its memory before its files), and its parent's
    command line, kept beside, still tells a Ray worker (raylet starts them) from the rest."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.seen, self._done = roots, {}, threading.Event()  # pid -> (cmdline, {addr})
        self.parents: dict[int, str] = {}  # pid -> the parent's command line

    def run(self) -> None:
        while not self._done.wait(0.3):
            for root in self.roots:
                try:
                    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for proc in procs:
                    try:
                        socks = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
                        cmdline = " ".join(proc.cmdline())
                        parent = proc.parent()
                        parent_cmdline = " ".join(parent.cmdline()) if parent else ""
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
                    self.record(proc.pid, cmdline, parent_cmdline, {f"{a.ip}:{a.port}" for a in socks})

    def record(self, pid: int, cmdline: str, parent_cmdline: str, addrs: set[str]) -> None:
        known, seen_addrs = self.seen.get(pid, ("", set()))
        self.seen[pid] = (max(known, cmdline, key=len), seen_addrs | addrs)
        if len(parent_cmdline) > len(self.parents.get(pid, "")):
            self.parents[pid] = parent_cmdline

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def beyond_loopback(self) -> dict[int, tuple[str, list[str]]]:
        """Every process that listened beyond loopback, with what it listened on. Ray's servers
        count too: the local cluster a run starts listens on loopback only."""
        found = {}
        for pid, (cmdline, addrs) in self.seen.items():
            wide = sorted(a for a in addrs if not loopback(a.rsplit(":", 1)[0]))
            if wide:
                found[pid] = (cmdline[:200] or f"(exited; parent {self.parents.get(pid, '')[:120]})", wide)
        return found
