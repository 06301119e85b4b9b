"""Test hosts on one machine: Linux network namespaces joined by a bridge, on shaped links.

Each host is a network namespace ``<prefix>-h<i>`` with one interface ``eth0`` at
``198.18.0.<i+1>/24`` (198.18.0.0/15 is the range reserved for benchmarking, RFC 2544). Its veth
peer ``v<i>`` sits in a namespace of its own, ``<prefix>-br``, on the bridge ``br0``, which joins
only these hosts: the root namespace and the machine's real interfaces are not touched.

Shaping (`Cluster.shape`) puts a `tc` token bucket (tbf) at ``rate`` on both ends of every host's
link, so each direction of each link carries at most ``rate``; an optional `netem` delay on the host
side adds that one-way latency between any two hosts.

Gloo picks the address it advertises from the host name, so every host gets
``/etc/netns/<ns>/hosts`` mapping its name (``<prefix>-h<i>``) and its peers' names to their
addresses, and `Cluster.command` runs a program in a fresh UTS namespace with that host name set.

Needs root. Everything is removed by `Cluster.down` (also on exit from a ``with`` block) or, after a
crash, by `cleanup`.

References:
  - ip-netns(8), tc-tbf(8), tc-netem(8); RFC 2544 for the 198.18.0.0/15 benchmarking range.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "bgn"
SUBNET = "198.18.0"  # inside 198.18.0.0/15, the benchmarking range
ETC_NETNS = "/etc/netns"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Private helpers ----------------------------------------------------------------------------------


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"netns: `{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def _namespaces(prefix: str) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def _tbf_burst_bytes(rate_mbit: float) -> int:
    # A bucket of ~2 ms of traffic: large enough for the timer resolution and 64 KiB GSO
    # segments, small enough that the rate holds over a transfer of many megabytes.
    return max(int(rate_mbit * 1e6 / 8 * 0.002), 64 * 1024)


def have_root() -> bool:
    """Whether this process can create network namespaces (root, with ip and tc installed)."""
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc", "unshare", "hostname"))


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Removes the namespaces and hosts files a crashed run with `prefix` left behind.

    Processes still inside those namespaces (our own benchmark workers) are killed first, by id.

    Returns:
      The namespace names removed.
    """
    removed = []
    for ns in _namespaces(prefix):
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    if os.path.isdir(ETC_NETNS):
        for entry in os.listdir(ETC_NETNS):
            if entry.startswith(prefix + "-"):
                shutil.rmtree(os.path.join(ETC_NETNS, entry), ignore_errors=True)
    return removed


@dataclass(frozen=True)
class Host:
    """One test host.

    Attributes:
      index: Position in the cluster, 0-based; host 0 runs the coordinator.
      namespace: Network namespace name, also the host name.
      address: IPv4 address of its ``eth0``.
    """

    index: int
    namespace: str
    address: str

    @property
    def hostname(self) -> str:
        return self.namespace


class Cluster:
    """`num_hosts` namespaces on one bridge; a context manager that always tears them down.

    Args:
      num_hosts: Number of hosts, 1..250.
      prefix: Name prefix of every namespace and hosts file this creates.
      pin: run host i's commands on CPU i mod (CPUs this process may use), as separate
        machines would each have their own cores; False lets every host use every CPU.

    Examples:
      >>> with Cluster(2) as c:  # doctest: +SKIP
      ...     c.shape(1000)
      ...     subprocess.run(c.command(1, ["ping", "-c1", c.hosts[0].address]))
    """

    def __init__(self, num_hosts: int, prefix: str = PREFIX, *, pin: bool = False):
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"netns: num_hosts={num_hosts} must be in 1..250")
        self.prefix = prefix
        self.pin = pin
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [Host(i, f"{prefix}-h{i}", f"{SUBNET}.{i + 1}") for i in range(num_hosts)]
        self._up = False

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Creates the bridge namespace, the hosts, their links and their hosts files."""
        if _namespaces(self.prefix):
            raise RuntimeError(
                f"netns: namespaces {_namespaces(self.prefix)} already exist (a crashed run?); "
                "remove them with `python benchmarks/network.py --cleanup`"
            )
        self._up = True  # from here on, down() must run whatever fails
        _run("ip", "netns", "add", self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.hostname}\n" for h in self.hosts
        )
        for h in self.hosts:
            _run("ip", "netns", "add", h.namespace)
            os.makedirs(os.path.join(ETC_NETNS, h.namespace), exist_ok=True)
            with open(os.path.join(ETC_NETNS, h.namespace, "hosts"), "w") as f:
                f.write(hosts_file)
            # Create the pair straight inside the two namespaces: nothing lands in the root one.
            _run(
                "ip", "link", "add", f"v{h.index}", "netns", self.bridge_ns, "type", "veth",
                "peer", "name", "eth0", "netns", h.namespace,
            )  # fmt: skip
            _run("ip", "-n", self.bridge_ns, "link", "set", f"v{h.index}", "master", "br0", "up")
            _run("ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _run("ip", "-n", h.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", h.namespace, "link", "set", "lo", "up")

    def shape(self, rate_mbit: float, delay_ms: float | None = None) -> None:
        """Limits every link to `rate_mbit` each way (0: no limit), with an optional one-way delay.

        The tbf sits on both veth ends (host egress and bridge egress); the netem delay, when
        given, only on the host side, so a packet between two hosts is delayed once.
        """
        if rate_mbit < 0:
            raise ValueError(f"netns: rate_mbit={rate_mbit} must be positive, or 0 for no limit")
        tbf = []  # no limit: netem alone, or nothing
        if rate_mbit:
            burst = str(_tbf_burst_bytes(rate_mbit))
            tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", burst, "latency", "100ms"]
        for h in self.hosts:
            for ns, dev, delayed in (
                (h.namespace, "eth0", True),
                (self.bridge_ns, f"v{h.index}", False),
            ):
                _run(
                    "ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False
                )
                if delay_ms and delayed:
                    _run(
                        "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                        "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000",
                    )  # fmt: skip
                    if tbf:
                        _run(
                            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                            "parent", "1:1", "handle", "10:", *tbf,
                        )  # fmt: skip
                elif tbf:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        """Returns `argv` wrapped to run on host `index`: its namespace and its host name."""
        h = self.hosts[index]
        cpus = sorted(os.sched_getaffinity(0))
        pin = ["taskset", "-c", str(cpus[index % len(cpus)])] if self.pin else []
        return [
            "ip", "netns", "exec", h.namespace, *pin,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', h.hostname, *argv,
        ]  # fmt: skip

    def launch(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        hugepages: bool = True,
        devices_per_proc: int = 1,
    ) -> int:
        """Runs the Python program `argv` as one JAX process per host, with
        `devices_per_proc` CPU devices each, under the library's launcher (host 0
        coordinates), with this checkout first on PYTHONPATH; its exit code."""
        from jax_bytegrad._src import checks as _checks
        from jax_bytegrad.launch import launch

        path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
        return launch(
            lambda rank: self.command(rank, argv),
            nproc=len(self.hosts),
            devices_per_proc=devices_per_proc,
            coordinator_host=self.hosts[0].address,
            port=_checks.free_port(),
            timeout=timeout,
            env=dict(os.environ, PYTHONPATH=path),
            hugepages=hugepages,
        )

    def down(self) -> None:
        """Removes every namespace and hosts file of this cluster; safe to call twice."""
        if self._up:
            cleanup(self.prefix)
            self._up = False
