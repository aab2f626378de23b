"""Which sockets a tree of processes listens on, sampled while it runs: the tests that start
whole runs check that nothing of the project's listens beyond loopback."""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path

import psutil

TCP_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


def loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also written as IPv4 in IPv6 (`::ffff:127.0.0.1`, how a server
    listening on IPv6 sockets shows a loopback-only bind)."""
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


def decode_address(hex_address: str, family: int) -> str:
    """`0100007F:1F90` (/proc/net/tcp: the address as the kernel's 32-bit words in this
    machine's byte order, the port big-endian) -> "127.0.0.1:8080", written as psutil writes it."""
    hex_ip, hex_port = hex_address.split(":")
    raw = bytes.fromhex(hex_ip)
    ip = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return f"{socket.inet_ntop(family, ip)}:{int(hex_port, 16)}"


def listening_sockets() -> dict[int, str]:
    """inode -> "ip:port" of every listening TCP socket in this network namespace."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = (Path("/proc/net") / name).read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == TCP_LISTEN:
                found[int(fields[9])] = decode_address(fields[1], family)
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets among a process's open files (`socket:[INODE]` links)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class Listeners(threading.Thread):
    """Every listening TCP socket of the processes under `roots` (their descendants included:
    Ray's daemons and workers, the served model), sampled every 0.3 s until `stop()`.

    A sample reads the machine's table of listening sockets once; only a socket not seen
    before sends it through the processes' open files to find whose it is. (psutil's
    per-process `net_connections` reads the whole table again for every process: over the
    fifty-odd processes of the suite's pipeline runs that was a third of a core.)

    A process is named by the longest command line any sample read: one first sampled while it
    exits reads as empty (the kernel frees its memory before its files), and its parent's
    command line, kept beside, still tells a Ray worker (raylet starts them) from the rest."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.seen, self._done = roots, {}, threading.Event()  # pid -> (cmdline, {addr})
        self.parents: dict[int, str] = {}  # pid -> the parent's command line
        self._known: set[int] = set()  # the inodes of listening sockets already looked for

    def run(self) -> None:
        while not self._done.wait(0.3):
            self.sample()

    def sample(self) -> None:
        """One reading: the new listening sockets, and which of the processes under the roots
        hold them (a socket none of them holds is another program's, looked for once)."""
        listening = listening_sockets()
        new = {inode: addr for inode, addr in listening.items() if inode not in self._known}
        if not new:
            return
        for root in self.roots:
            try:
                procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                try:
                    held = socket_inodes(proc.pid) & new.keys()
                    cmdline = " ".join(proc.cmdline())
                    parent = proc.parent()
                    parent_cmdline = " ".join(parent.cmdline()) if parent else ""
                except (OSError, psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                self.record(proc.pid, cmdline, parent_cmdline, {new[inode] for inode in held})
        self._known |= new.keys()

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
