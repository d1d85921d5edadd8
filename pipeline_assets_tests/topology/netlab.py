"""A private network of hosts on this machine: one network namespace per host, linked by veth pairs.

Every name carries the prefix ``topo`` and this process's pid (namespaces ``topo<pid>-<host>``, the
test process's own link ``topo<pid>t``), so two sessions never share anything and a later session can
remove what a dead one left (:func:`remove_leftovers`). The hosts hang off a bridge that lives in a
namespace of its own (``topo<pid>-lab``); each host's end of its pair is ``eth0`` in its namespace,
the other end a bridge port in the lab. The test process (the root namespace) gets a pair too, so it
can reach the hosts directly. Addresses: one private /24 that no route of this machine covers,
assigned only to the interfaces created here.

Faults are applied to a host's link: :meth:`Lab.link_down` (a partition, from the bridge side, so the
host sees its peer gone), :meth:`Lab.netem` (delay and loss on both ends of the pair).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "topo"
NAME_RE = re.compile(rf"^{PREFIX}(\d+)(?:-|t$)")
SUBNET_BASE = ipaddress.ip_network("10.213.0.0/16")  # a /24 of it is chosen per session
BRIDGE = "br0"
COMMAND_TIMEOUT = 30


class LabError(RuntimeError):
    pass


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process inside ``ns`` (bounded: a few passes)."""
    for _ in range(5):
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def remove_leftovers() -> list[str]:
    """Namespaces and links of this prefix whose session (pid) is gone: their processes killed,
    then deleted. Returns what was removed."""
    removed = []
    for ns in _namespaces():
        m = NAME_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            kill_namespace_processes(ns)
            ip("netns", "delete", ns, check=False)
            removed.append(ns)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = NAME_RE.match(name)
        if m and not _alive(int(m.group(1))):
            ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNET_BASE no route here covers, chosen from the pid (bounded: 256 candidates)."""
    routes = [
        ipaddress.ip_network(r.split()[0])
        for r in ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines()
        if r and r.split()[0][0].isdigit()
    ]
    subnets = list(SUBNET_BASE.subnets(new_prefix=24))
    start = os.getpid() % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(r) for r in routes if r.prefixlen > 0):
            return net
    raise LabError("no free /24 in " + str(SUBNET_BASE))


@dataclass
class Lab:
    """The namespaces, links and addresses of one session; :meth:`close` removes all of them."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, str] = field(default_factory=dict)  # host -> its address
    subnet: ipaddress.IPv4Network | None = None
    _next: int = 2

    @property
    def lab_ns(self) -> str:
        return f"{self.tag}-lab"

    @property
    def test_link(self) -> str:
        return f"{self.tag}t"

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def port(self, host: str) -> str:
        return f"p-{host}"[:15]

    def open(self) -> Lab:
        remove_leftovers()
        self.subnet = _free_subnet()
        ip("netns", "add", self.lab_ns)
        ip("link", "set", "lo", "up", netns=self.lab_ns)
        ip("link", "add", BRIDGE, "type", "bridge", netns=self.lab_ns)
        ip("link", "set", BRIDGE, "up", netns=self.lab_ns)
        # The test process's own link: the root namespace reaches the hosts through it.
        ip("link", "add", self.test_link, "type", "veth", "peer", "name", "p-test", "netns", self.lab_ns)
        ip("link", "set", "p-test", "master", BRIDGE, "up", netns=self.lab_ns)
        ip("addr", "add", f"{self.subnet[1]}/24", "dev", self.test_link)
        ip("link", "set", self.test_link, "up")
        return self

    def add_host(self, host: str) -> str:
        """A namespace linked to the bridge; returns its address."""
        assert self.subnet is not None, "open() first"
        ns, port = self.ns(host), self.port(host)
        address = str(self.subnet[self._next])
        self._next += 1
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", netns=ns)
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.lab_ns)
        ip("link", "set", port, "master", BRIDGE, "up", netns=self.lab_ns)
        ip("addr", "add", f"{address}/24", "dev", "eth0", netns=ns)
        ip("link", "set", "eth0", "up", netns=ns)
        self.hosts[host] = address
        return address

    def exec_prefix(self, host: str) -> list[str]:
        """Prefix of a command that runs inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def link_down(self, host: str) -> None:
        ip("link", "set", self.port(host), "down", netns=self.lab_ns)

    def link_up(self, host: str) -> None:
        ip("link", "set", self.port(host), "up", netns=self.lab_ns)

    def netem_supported(self) -> bool:
        """Whether this kernel has the netem qdisc (tried on the lab's own test port, then removed)."""
        cmd = ["ip", "netns", "exec", self.lab_ns, "tc", "qdisc"]
        done = subprocess.run(
            [*cmd, "add", "dev", "p-test", "root", "netem", "delay", "1ms"],
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
        )
        subprocess.run([*cmd, "del", "dev", "p-test", "root"], capture_output=True, timeout=COMMAND_TIMEOUT)
        return done.returncode == 0

    def netem(self, host: str, spec: str | None, *, peer: str | None = None) -> None:
        """``tc netem`` with ``spec`` (e.g. ``delay 50ms loss 0.5%``) on both ends of the host's pair,
        so a round trip crosses it twice; with ``peer`` (an address) only the traffic between the
        host and that peer (a prio qdisc whose third band has the netem, chosen by a u32 filter).
        None removes it."""
        for ns, dev, match in ((self.ns(host), "eth0", "dst"), (self.lab_ns, self.port(host), "src")):

            def tc(*args: str, check: bool = True, ns: str = ns) -> None:
                done = subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
                )
                if check and done.returncode != 0:
                    raise LabError(f"tc {' '.join(args)} on {host}: {done.stderr.strip()}")

            tc("qdisc", "del", "dev", dev, "root", check=False)
            if spec is None:
                continue
            if peer is None:
                tc("qdisc", "add", "dev", dev, "root", "netem", *spec.split())
                continue
            tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "prio")
            tc("qdisc", "add", "dev", dev, "parent", "1:3", "handle", "30:", "netem", *spec.split())
            tc(
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:0",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                match,
                f"{peer}/32",
                "flowid",
                "1:3",
            )

    def close(self) -> None:
        """Kill every process in the hosts' namespaces, delete the namespaces and the test link."""
        for ns in [self.ns(h) for h in self.hosts] + [self.lab_ns]:
            kill_namespace_processes(ns)
            ip("netns", "delete", ns, check=False)
        ip("link", "delete", self.test_link, check=False)
        self.hosts.clear()
