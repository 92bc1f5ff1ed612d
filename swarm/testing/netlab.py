"""A small internet of network namespaces, for NAT tests and benchmarks (root only).

Topology (every name starts with ``swnat-<pid>-``, so a leftover is found with ``ip netns list`` and removed by
``python -m swarm.testing.netlab clean``)::

    wan        a bridge: the internet
    pubN       public machines on the bridge: pub1 runs the bootstrap peer, the others more public peers; all relay
    rtrN       home N's router: WAN side on the bridge, LAN side 192.168.N.1, MASQUERADE, no inbound ports
    homeN      a machine in home N (192.168.N.2) behind rtrN; the client's home is one more of them

The internet uses a public-looking range (``LabConfig.wan_network``) *inside these namespaces only*: libp2p's
AutoNAT and hole punching ignore private (RFC 1918) addresses, so with a 10.x internet every peer would look
like a LAN neighbour and NAT traversal would never even be attempted. Nothing here touches the host's own
interfaces, addresses or routes. Per-link delay needs the netem qdisc; :func:`netem_available` measures
whether the kernel has it.

``with NetLab(LabConfig(homes=3)) as lab:`` builds it; leaving the block (also on an exception, Ctrl-C or
SIGTERM) stops every process started in it and deletes every namespace. An ``atexit`` hook does the same if
the interpreter exits with the lab still up; after a ``kill -9`` the next lab removes the leftovers.

Inside, ``lab.start_public_peers()``, ``lab.start_server("home1", "0:8")`` and ``lab.start_client("client1")``
run the swarm's own commands; the client is ``python -m swarm.testing.netlab client`` (below), which prints one
JSON event per line. ``python -m swarm.testing.netlab up`` builds a lab to look at by hand.
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from swarm.utils.errors import SwarmError
from swarm.utils.forkserver import ForkedProcess, ForkServer, forkable
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess, swarm_env

logger = logging.getLogger(__name__)

PREFIX = "swnat-"
# The folder holding this copy of the package (a checkout's root): ``python -m swarm.testing.netlab`` started there
# in a lab machine runs this code, not another installed copy.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME_PATTERN = re.compile(rf"^{PREFIX}(\d+)-")


class LabUnavailable(SwarmError, RuntimeError):
    """This machine cannot build the lab (not root, no ``ip netns``, no iptables); the message says why."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> Optional[str]:
    """Why the lab cannot run here, or None when it can (checked for real: a namespace with a NAT rule)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces and iptables)"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"the NAT lab needs {' and '.join(missing)} (apt-get install -y iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' does not work here: {made.stderr.strip()}"
        nat = _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE",
                   check=False)
        if nat.returncode != 0:
            return f"iptables cannot add a MASQUERADE rule in a namespace: {nat.stderr.strip()}"
        return None
    finally:
        _run("ip", "netns", "del", probe, check=False)


def netem_available(namespace: str) -> bool:
    """Whether the kernel offers the netem qdisc (per-link delay), tried on ``namespace``'s loopback."""
    added = _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                 "1ms", check=False)
    if added.returncode == 0:
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return added.returncode == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def clean_leftovers(only_dead: bool = True) -> list[str]:
    """Delete lab namespaces (and kill what runs in them) left by labs whose process is gone, and their folders of
    identity keys; returns the namespaces.

    With ``only_dead=False`` every lab's go, also those of a lab still running.
    """
    def left(name: str) -> bool:
        match = NAME_PATTERN.match(name)
        return bool(match) and (not only_dead or not _pid_alive(int(match.group(1))))

    removed = [name for name in _run("ip", "netns", "list", check=False).stdout.split() if left(name)]
    for name in removed:
        _delete_namespace(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-identities-*"):
        if left(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


def _kill_namespace_processes(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def netns_path(namespace: str) -> str:
    """The file of a network namespace that ``ip netns add`` made, which a fork server's child enters."""
    return f"/run/netns/{namespace}"


def _wait_inside(process: subprocess.Popen, namespace: str, timeout: float = 30.0) -> None:
    """Return once ``process`` runs in ``namespace`` (or has ended): until ``ip netns exec`` has entered it, killing
    the namespace's processes (a lab's cleanup) would miss it, and it would then run on outside any lab."""
    wanted = os.stat(netns_path(namespace)).st_ino
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if os.stat(f"/proc/{process.pid}/ns/net").st_ino == wanted:
                return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def _delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    _run("ip", "netns", "del", namespace, check=False)


@dataclass
class LabConfig:
    """The lab's shape. ``homes`` server homes plus ``client_homes`` more for clients, each behind its own NAT."""

    homes: int = 3
    client_homes: int = 1
    # Public machines, one peer each (bootstrap and relays): libp2p's autorelay waits 3 minutes unless it knows 4
    # relays, and counts observers of a NATed peer's address by IP.
    public_peers: int = 4
    wan_network: str = "44.0.0.0/24"  # public-looking, used only inside the lab's namespaces (see module doc)
    # Homes whose router picks a random port per connection (a "symmetric" NAT, --random-fully): hole punching
    # cannot guess the port, so peers there are reachable only through relays. The others keep ports (cone-like).
    symmetric_nat: tuple[str, ...] = ()
    peer_port: int = 31337
    delay_ms: float = 0.0  # one-way delay on every home router's WAN link, when the kernel has netem
    # Start the peers, servers and clients by forking one process that imported torch and hivemind, into their
    # machine's namespace (swarm.utils.forkserver): the same commands, about 2 CPU s less each. False: exec'd.
    fork_server: bool = True


@dataclass
class Machine:
    """One namespace that runs processes: its address, and the address the internet sees it from."""

    role: str
    namespace: str
    address: str
    public_address: str
    router: Optional[str] = None  # the router namespace in front of it (None: on the internet itself)


class NamespacedSwarm(LocalSwarm):
    """A :class:`LocalSwarm` whose processes run in one namespace.

    With ``forks`` (the lab's fork server) each process is forked into the namespace (``ForkServer.start(...,
    netns=)``): the same command, without importing torch and hivemind again (about 2 CPU s a process). Without,
    ``ip netns exec NS python ...``, which execs the interpreter in place, so the process (and its group, which
    ``terminate`` kills) is the Python process itself.
    """

    def __init__(self, namespace: str, peers: Sequence[str] = (), env: Optional[dict[str, str]] = None,
                 startup_timeout: float = 120, forks: Optional[ForkServer] = None):
        super().__init__(python="ip", env=env, startup_timeout=startup_timeout, shared_forks=forks)
        self.namespace = namespace
        self.peers = list(peers)

    @property
    def initial_peers(self) -> list[str]:
        return list(self.peers)

    def _start(self, name: str, args: Sequence[str], wait: bool = True, log: Optional[Path] = None,
               env: Optional[dict[str, str]] = None) -> ManagedProcess:
        forked = self.fork_server and forkable(args)
        inside = list(args) if forked else ["netns", "exec", self.namespace, sys.executable, *args]
        managed = super()._start(name, inside, wait, log, env)
        managed.args = list(args)  # what :meth:`restart` passes here again
        return managed

    def _fork(self, args: Sequence[str], env: dict[str, str], cwd: Optional[str] = None) -> ForkedProcess:
        return self._forks.start(args, netns=netns_path(self.namespace), env=env, cwd=cwd)

    def start(self, name: str, args: Sequence[str], wait: bool = True) -> ManagedProcess:
        """Any ``python ARGS`` that prints a READY line (``swarm.dht``, ``swarm.server``)."""
        return self._start(name, args, wait)


class ClientFailed(SwarmError, RuntimeError):
    """The lab client reported an error (its ``ERROR`` event): ``error`` is the exception's class name."""

    def __init__(self, error: str, message: str):
        super().__init__(f"{error}: {message}")
        self.error, self.message = error, message


class LabClient:
    """A client process in the lab. It prints one ``KIND {json}`` line per event: JOINED, STEP, HELD (waiting for
    :meth:`release`; :meth:`paths` asks it for PATHS meanwhile), RESULT or ERROR; its log comes on the same pipe
    (:meth:`NetLab.start_python`), and is kept in ``log``."""

    KINDS = ("JOINED", "STEP", "HELD", "PATHS", "RESULT", "ERROR")

    def __init__(self, process: "subprocess.Popen | ForkedProcess"):
        self.process = process
        self.events: "queue.Queue[tuple[str, dict]]" = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            kind, _, payload = line.strip().partition(" ")
            if kind in self.KINDS:
                self.events.put((kind, json.loads(payload)))
            else:
                self.log.append(line)

    def wait_for(self, kind: str, timeout: float) -> dict:
        """The next ``kind`` event. Raises :class:`ClientFailed` on an ERROR event, and RuntimeError with the
        client's last log lines if it exits or says nothing for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got, payload = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and self.events.empty():
                    break
                continue
            if got == "ERROR":
                raise ClientFailed(payload["error"], payload["message"])
            if got == kind:
                return payload
        state = "exited" if self.process.poll() is not None else f"gave no {kind} in {timeout:.0f} s"
        raise RuntimeError(f"lab client {state}; its log ends:\n" + "".join(self.log[-25:]))

    def paths(self, timeout: float = 30) -> dict[str, list[str]]:
        """A held client's connection paths now, per peer id (as in its HELD and RESULT events)."""
        self.process.stdin.write("paths\n")
        self.process.stdin.flush()
        return self.wait_for("PATHS", timeout)["paths"]

    def release(self) -> None:
        """Let a client held at ``--hold-at-step`` go on."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@dataclass
class NetLab:
    """Builds the namespaces on ``__enter__`` and tears everything down on ``__exit__`` (see module doc)."""

    config: LabConfig = field(default_factory=LabConfig)
    machines: dict[str, Machine] = field(default_factory=dict)
    wan: str = ""  # the internet's namespace (the bridge)
    delay_ms: float = 0.0  # the delay actually applied (0 when netem is missing)
    delay_note: str = ""
    initial_peers: list[str] = field(default_factory=list)  # the public peers' multiaddrs, once started
    _namespaces: list[str] = field(default_factory=list)
    _swarms: dict[str, NamespacedSwarm] = field(default_factory=dict)
    _forks: Optional[ForkServer] = None  # started with the first machine's swarm (config.fork_server)
    _clients: list["LabClient"] = field(default_factory=list)
    _previous_sigterm: Any = None
    _identities: str = ""  # a folder holding each public peer's identity key, so a restart keeps its peer id

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{os.getpid()}-"

    # ----- building ------------------------------------------------------------------------------
    def __enter__(self) -> "NetLab":
        reason = unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        clean_leftovers(only_dead=True)
        atexit.register(self.close)
        self._catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _catch_sigterm(self) -> None:
        """SIGTERM would end the interpreter without unwinding ``with`` blocks: make it raise instead."""
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _raise_system_exit)

    def _build(self) -> None:
        self._identities = tempfile.mkdtemp(prefix=f"{self.prefix}identities-")
        wan = ipaddress.ip_network(self.config.wan_network)
        hosts = wan.hosts()
        self.wan = self._namespace("wan")
        self._ns(self.wan, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.wan, "ip", "link", "set", "br0", "up")
        for index in range(1, self.config.public_peers + 1):
            role, address = f"pub{index}", str(next(hosts))
            namespace = self._namespace(role)
            self._wan_link(namespace, role, address, wan.prefixlen)
            self.machines[role] = Machine(role, namespace, address, address)
        roles = [f"home{i}" for i in range(1, self.config.homes + 1)]
        roles += [f"client{i}" for i in range(1, self.config.client_homes + 1)]
        for index, role in enumerate(roles, start=1):
            self.machines[role] = self._home(role, index, str(next(hosts)), wan.prefixlen)
        self._apply_delay()

    def _namespace(self, role: str) -> str:
        name = f"{self.prefix}{role}"
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        self._ns(name, "ip", "link", "set", "lo", "up")
        return name

    def _ns(self, namespace: str, *command: str) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", namespace, *command)

    def _wan_link(self, namespace: str, role: str, address: str, prefixlen: int) -> None:
        """Plug ``namespace`` into the internet bridge as interface ``wan0`` with ``address``; the bridge's end of
        the cable is ``v-ROLE``."""
        port = f"v-{role}"[:15]
        _run("ip", "link", "add", "wan0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", self.wan)
        self._ns(self.wan, "ip", "link", "set", port, "master", "br0", "up")
        self._ns(namespace, "ip", "addr", "add", f"{address}/{prefixlen}", "dev", "wan0")
        self._ns(namespace, "ip", "link", "set", "wan0", "up")

    def _home(self, role: str, index: int, wan_address: str, prefixlen: int) -> Machine:
        """A router with MASQUERADE and no inbound ports, and one machine behind it on 192.168.<index>.0/24."""
        router = self._namespace(f"rtr{index}")
        machine = self._namespace(role)
        self._wan_link(router, f"rtr{index}", wan_address, prefixlen)
        lan_router, lan_machine = f"192.168.{index}.1", f"192.168.{index}.2"
        _run("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", machine)
        self._ns(router, "ip", "addr", "add", f"{lan_router}/24", "dev", "lan0")
        self._ns(router, "ip", "link", "set", "lan0", "up")
        self._ns(machine, "ip", "addr", "add", f"{lan_machine}/24", "dev", "eth0")
        self._ns(machine, "ip", "link", "set", "eth0", "up")
        self._ns(machine, "ip", "route", "add", "default", "via", lan_router)
        self._ns(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["-j", "MASQUERADE"] + (["--random-fully"] if role in self.config.symmetric_nat else [])
        rules = [
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan0", *masquerade],
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT"],
            ["-P", "INPUT", "DROP"],
            ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
            ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ]
        for rule in rules:
            self._ns(router, "iptables", *rule)
        return Machine(role, machine, lan_machine, wan_address, router)

    def _apply_delay(self) -> None:
        if not self.config.delay_ms:
            return
        if not netem_available(self.wan):
            self.delay_note = f"no delay: this kernel has no netem qdisc ({self.config.delay_ms:g} ms asked)"
            logger.warning("%s", self.delay_note)
            return
        for machine in self.machines.values():
            if machine.router:
                self._ns(machine.router, "tc", "qdisc", "add", "dev", "wan0", "root", "netem", "delay",
                         f"{self.config.delay_ms:g}ms")
        self.delay_ms = self.config.delay_ms

    # ----- using -------------------------------------------------------------------------------
    def swarm(self, role: str) -> NamespacedSwarm:
        """The process launcher of ``role``'s machine; its servers join the lab's public peers."""
        if role not in self._swarms:
            self._swarms[role] = NamespacedSwarm(self.machines[role].namespace, self.initial_peers,
                                                 forks=self._fork_server())
        return self._swarms[role]

    def _fork_server(self) -> Optional[ForkServer]:
        """The lab's fork server (``LabConfig.fork_server``), started on first use: it imports while the first
        command waits for it. None when the lab execs."""
        if self.config.fork_server and self._forks is None:
            self._forks = ForkServer(env=swarm_env())
        return self._forks

    @property
    def public_roles(self) -> list[str]:
        return [role for role, machine in self.machines.items() if role.startswith("pub")]

    def public_processes(self) -> list[ManagedProcess]:
        return [p for role in self.public_roles for p in self.swarm(role).processes]

    def start_public_peers(self) -> list[ManagedProcess]:
        """``python -m swarm.dht`` on every public machine, at ``peer_port``: the first is the bootstrap peer, the
        others join it (started together once it runs); ``initial_peers`` lists them all."""
        first, *others = self.public_roles
        started = [self._start_public_peer(first, wait=True)]
        started += [self._start_public_peer(role, wait=False) for role in others]
        for process in started[1:]:
            self.wait_ready(process)
        self.initial_peers = [m for p in started for m in p.maddrs if "/ip4/127." not in m]
        return started

    def _start_public_peer(self, role: str, wait: bool) -> ManagedProcess:
        address = self.machines[role].address
        args = ["-m", "swarm.dht", "--host-maddrs", f"/ip4/{address}/tcp/{self.config.peer_port}",
                "--identity-path", os.path.join(self._identities, f"{role}.key")]
        for peer in self.initial_peers:
            if f"/ip4/{address}/" not in peer:
                args += ["--initial-peers", peer]
        process = self.swarm(role).start(role, args, wait=wait)
        if not self.initial_peers:
            self.initial_peers = [m for m in process.maddrs if f"/ip4/{address}/" in m]
        return process

    def restart_public_peer(self, process: ManagedProcess) -> ManagedProcess:
        """A public peer killed by a test, started again on its machine with its identity and port: its multiaddrs
        (in ``initial_peers``, which every later process is given) name a live peer again, so the lab is as it
        was for the tests after. It joins every other public peer."""
        role = next(role for role in self.public_roles if process in self.swarm(role).processes)
        if process.alive:
            self.terminate(process, signal.SIGKILL)
        return self._start_public_peer(role, wait=True)

    def start_server(self, role: str, blocks: str, *extra: str, model: str = "default",
                     wait: bool = True) -> ManagedProcess:
        """``python -m swarm.server`` on ``role``'s machine, joining the public peers."""
        return self.swarm(role).start_server(model, blocks, "--compute-threads", "1", *extra,
                                             name=f"{role}-{blocks}", wait=wait)

    def wait_ready(self, process: ManagedProcess) -> None:
        self._owner(process).wait_ready(process)

    def terminate(self, process: ManagedProcess, sig: int = signal.SIGTERM) -> Optional[int]:
        return self._owner(process).terminate(process, sig)

    def _owner(self, process: ManagedProcess) -> NamespacedSwarm:
        return next(s for s in self._swarms.values() if process in s.processes)

    def start_client(self, role: str, *args: str) -> "LabClient":
        """``python -m swarm.testing.netlab client`` on ``role``'s machine, joining the public peers
        (:class:`LabClient`)."""
        peers = [arg for peer in self.initial_peers for arg in ("--initial-peers", peer)]
        client = LabClient(self.start_python(role, ["-m", "swarm.testing.netlab", "client", *peers, *args],
                                             stdin=True))
        self._clients.append(client)
        return client

    def start_python(self, role: str, args: Sequence[str], stdin: bool = False) -> "subprocess.Popen | ForkedProcess":
        """``python -m MODULE ...`` on ``role``'s machine, run from this package's folder (so that it runs this
        code), its stdout and stderr together on ``stdout`` and, with ``stdin``, a pipe to its standard input:
        forked into the machine's namespace by the lab's fork server (``LabConfig.fork_server``), else exec'd there.
        Stopped with the lab at the latest."""
        if not self.config.fork_server:
            return self.popen(role, args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=PACKAGE_PARENT)
        return self._fork_server().start(args, netns=netns_path(self.machines[role].namespace), stdin=stdin,
                                         cwd=PACKAGE_PARENT)

    def wan_bytes(self, role: str) -> tuple[int, int]:
        """(received, sent) bytes so far on ``role``'s internet cable (its router's, behind NAT)."""
        machine = self.machines[role]
        shown = json.loads(_run("ip", "-j", "-s", "-n", machine.router or machine.namespace, "link", "show",
                                "wan0").stdout)
        stats = shown[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def popen(self, role: str, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``python ARGS`` in ``role``'s namespace (its own process group; killed with the lab at the latest)."""
        namespace = self.machines[role].namespace
        process = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, *args], start_new_session=True,
                                   **kwargs)
        _wait_inside(process, namespace)
        return process

    def exec(self, role: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command in a machine's or router's namespace (``"rtr1"``, ``"wan"``, or a machine's role)."""
        namespace = self.machines[role].namespace if role in self.machines else f"{self.prefix}{role}"
        return _run("ip", "netns", "exec", namespace, *command, check=check)

    def describe(self) -> str:
        lines = [f"{m.role:8} {m.namespace:28} {m.address:15} seen as {m.public_address}"
                 for m in self.machines.values()]
        return "\n".join(lines + ([self.delay_note] if self.delay_note else []))

    # ----- tearing down ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process, delete every namespace; safe to call twice, never raises."""
        for client in self._clients:
            client.kill()
        self._clients.clear()
        for swarm in reversed(list(self._swarms.values())):
            try:
                swarm.stop()
            except Exception as error:  # the namespaces must go whatever happened to a process
                logger.warning("stopping processes failed: %s", error)
        self._swarms.clear()
        if self._forks is not None:
            self._forks.close()
            self._forks = None
        for namespace in reversed(self._namespaces):
            _delete_namespace(namespace)
        self._namespaces.clear()
        if self._identities:
            shutil.rmtree(self._identities, ignore_errors=True)
            self._identities = ""
        atexit.unregister(self.close)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def relay_wait_seconds(server: ManagedProcess) -> Optional[float]:
    """How long a server behind NAT waited for its relay reservation, from its log (None: no relay needed)."""
    for line in server.log:
        found = re.search(r"reachable through \d+ relay\(s\) after ([\d.]+) s", line)
        if found:
            return float(found.group(1))
    return None


# ----- a client inside the lab: ``python -m swarm.testing.netlab client ...`` in a machine's namespace -------
def connection_paths(peers: Sequence[Any]) -> dict[str, list[str]]:
    """Peer id -> the remote multiaddrs of this daemon's open connections to it (``/p2p-circuit``: relayed)."""
    paths: dict[str, list[str]] = {}
    for info in peers:
        paths.setdefault(str(info.peer_id), []).extend(str(addr) for addr in info.addrs)
    return paths


def path_kind(addresses: Sequence[str]) -> str:
    """``direct`` when some connection to the peer is direct, ``relayed`` when all go through a relay."""
    if not addresses:
        return "none"
    return "relayed" if all("/p2p-circuit" in a for a in addresses) else "direct"


def _emit(kind: str, **fields: Any) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def run_client(args: argparse.Namespace) -> None:
    """Join, generate ``--runs`` times (one line per step), then report tokens, timings and connection paths."""
    from swarm.client import DistributedDiffusionLM
    from swarm.dht.node import NetworkConfig

    started = time.perf_counter()
    network = NetworkConfig(initial_peers=list(args.initial_peers), use_auto_relay=args.use_auto_relay,
                            client_mode=True, use_default_peers=False)
    if args.host_maddrs:
        network.host_maddrs = list(args.host_maddrs)
    lm = DistributedDiffusionLM.from_pretrained(args.model, network=network, request_timeout=args.request_timeout,
                                                connect_timeout=args.connect_timeout, dht_prefix=args.dht_prefix)
    _emit("JOINED", seconds=time.perf_counter() - started)
    try:
        runs = [_generate(lm, args, run) for run in range(args.runs)]
        paths = connection_paths(lm.loop.run(lm.p2p.list_peers()))
        _emit("RESULT", runs=runs, paths=paths, route=_route(lm), bytes_sent=lm.caller.bytes_sent,
              bytes_received=lm.caller.bytes_received)
    except Exception as error:  # reported as an event: the test decides whether this failure is a clear one
        _emit("ERROR", error=type(error).__name__, message=str(error))
        raise SystemExit(1)
    finally:
        lm.shutdown()


def _route(lm: Any) -> list[dict]:
    return [{"peer_id": hop.peer_id, "span": [hop.start, hop.end]} for hop in lm.planner.route]


def _generate(lm: Any, args: argparse.Namespace, run: int) -> dict:
    begun, steps, result = time.perf_counter(), [], None
    for chunk in lm.generate_stream(args.prompt, **json.loads(args.settings)):
        steps.append(time.perf_counter() - begun)
        _emit("STEP", run=run, step=chunk.step, seconds=steps[-1], route=_route(lm))
        if run == 0 and chunk.step == args.hold_at_step:
            _emit("HELD", step=chunk.step, route=_route(lm), paths=connection_paths(lm.loop.run(lm.p2p.list_peers())))
            while sys.stdin.readline().strip() == "paths":  # asked while held: the connections now; "go" goes on
                _emit("PATHS", paths=connection_paths(lm.loop.run(lm.p2p.list_peers())))
        result = chunk.result or result
    return {"token_ids": result.token_ids, "step_seconds": steps, "route": result.info["route"],
            "failovers": result.info["failovers"], "elapsed_s": result.elapsed_s}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    clean = commands.add_parser("clean", help="delete the namespaces (and processes) of labs whose process is gone")
    clean.add_argument("--all", action="store_true", help="also those of labs still running")
    up = commands.add_parser("up", help="build a lab, print it, and wait for Ctrl-C")
    up.add_argument("--homes", type=int, default=3, help="homes with a server each")
    up.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per home link (needs netem)")
    client = commands.add_parser("client", help="run a client here (inside a lab machine: ip netns exec ...)")
    client.add_argument("--initial-peers", action="append", required=True, help="bootstrap multiaddr (repeatable)")
    client.add_argument("--host-maddrs", action="append", default=None,
                        help="multiaddrs to listen on (default: NetworkConfig's)")
    client.add_argument("--use-auto-relay", action="store_true", help="look for relays (behind NAT)")
    client.add_argument("--model", default="default", help="embedded model name or checkpoint directory")
    client.add_argument("--prompt", default="nat", help="prompt of every run")
    client.add_argument("--settings", default="{}", help="generate() keyword arguments as JSON")
    client.add_argument("--runs", type=int, default=1, help="generations, one after the other")
    client.add_argument("--request-timeout", type=float, default=20.0, help="ClientConfig.request_timeout")
    client.add_argument("--connect-timeout", type=float, default=5.0, help="ClientConfig.connect_timeout")
    client.add_argument("--dht-prefix", default=None, help="the model's DHT prefix (default: the model's name)")
    client.add_argument("--hold-at-step", type=int, default=-1,
                        help="in the first run, after this step print HELD and wait for a line on stdin")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if args.command == "client":
        run_client(args)
        return
    if args.command == "clean":
        print(json.dumps(clean_leftovers(only_dead=not args.all)))
        return
    with NetLab(LabConfig(homes=args.homes, delay_ms=args.delay_ms)) as lab:
        print(lab.describe(), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
