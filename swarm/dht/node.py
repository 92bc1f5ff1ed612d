"""Starting a hivemind DHT peer with the swarm's network options (one place for every command).

Besides starting the peer, this module makes sure of two things a user should never have to check:

* **No port is shared by accident.** libp2p listens with ``SO_REUSEPORT``, so a second daemon on a port in
  use starts as if nothing were wrong and the kernel splits incoming connections between the two. Every
  listening multiaddr is therefore probed first with a plain socket (:func:`check_listen_addresses`), and a
  port in use is refused with :class:`AddressInUseError`, naming it.
* **No daemon outlives its parent**, however the parent dies (``kill -9`` included). A DHT peer is two
  processes below the caller: hivemind's DHT process, and the ``p2pd`` daemon it starts. The DHT process
  exits when its starter is gone (:func:`follow_parent`), and each ``p2pd`` gets ``PR_SET_PDEATHSIG`` from a
  tiny launcher (:func:`guard_daemons`), so the kernel kills it when the DHT process dies.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import re
import socket
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from multiaddr import Multiaddr

from swarm.dht.config import LOOPBACK_MADDRS, NetworkConfig
from swarm.dht.identity import Identity
from swarm.dht.keys import policy_for, trusted_keys
from swarm.dht.nat import listen_addresses, relay_plan, relay_wanted, wait_for_relay
from swarm.dht.peers import resolve_initial_peers
from swarm.dht.sockets import remove_dead_sockets_now_and_then
from swarm.dht.validation import (
    STORE_SENDER,
    KeyPolicy,
    ProtectedStorage,
    dht_key_id,
    protect_storage,
    swarm_validators,
)
from swarm.utils.errors import EXIT_IN_USE, EXIT_UNREACHABLE, SwarmError
from swarm.utils.parent_death import die_with_parent
from swarm.utils.text import plural

logger = logging.getLogger(__name__)

ORPHAN_POLL_S = 0.25  # how often a DHT process started from a non-main thread checks that its starter lives
FAILED_REPLY_WARN_S = 60.0  # one warning per peer per this many seconds about replies lost on protected keys


class AddressInUseError(SwarmError, RuntimeError):
    """A port to listen on, or a libp2p identity, is already used by another process."""

    exit_code = EXIT_IN_USE


class SwarmJoinError(SwarmError, RuntimeError):
    """The DHT peer could not start or reach any initial peer."""

    exit_code = EXIT_UNREACHABLE


# ----- ports ---------------------------------------------------------------------------------------
def check_port_free(host: str, port: int, transport: str = "tcp", where: str = "") -> None:
    """Raise :class:`AddressInUseError` if another socket listens on ``host:port`` (``transport`` tcp or udp).

    The probe binds without ``SO_REUSEPORT``, so a daemon listening there with it still blocks the bind; for TCP
    it sets ``SO_REUSEADDR``, which on Linux passes connections in TIME_WAIT (a restart) but never a listener.
    Port 0 (any free port) is always free. ``where`` names the flag for the message.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    kind = socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM
    with socket.socket(family, kind) as probe:
        if kind == socket.SOCK_STREAM:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise AddressInUseError(f"port {port} ({transport}) is already in use{where}: another process listens "
                                        "on it (a server or DHT peer already running?); choose another port or stop "
                                        "that process") from None
            if error.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"cannot listen on {host}{where}: not an address of this machine") from None
            if error.errno == errno.EACCES:
                raise ValueError(f"port {port}{where} needs privileges; choose a port above 1023") from None
            raise


def check_listen_addresses(maddrs: Iterable[str], flag: str = "--host-maddrs") -> None:
    """Check every ``/ip4|ip6/HOST/tcp|udp/PORT...`` multiaddr to listen on (others are left to libp2p)."""
    for text in maddrs:
        try:
            addr = Multiaddr(str(text))
        except ValueError:
            expected = "expected e.g. /ip4/0.0.0.0/tcp/31337"
            raise ValueError(f"{flag}: {str(text)!r} is not a multiaddr; {expected}") from None
        parts = [(p.name, addr.value_for_protocol(p.code)) for p in addr.protocols()][:2]
        if len(parts) == 2 and parts[0][0] in ("ip4", "ip6") and parts[1][0] in ("tcp", "udp"):
            (_, host), (transport, port) = parts
            check_port_free(host, int(port), transport, where=f" ({flag} {text})")


# ----- daemons that die with their parent ----------------------------------------------------------
# Runs in the child between fork and p2pd: the death signal survives exec, and a parent that died before the
# prctl is caught by the parent-pid check. It execs p2pd in place, so hivemind signals and waits for the same pid.
# p2pd gets its own process group: a Ctrl-C in a terminal signals the foreground group, and a p2pd interrupted
# there closed its sockets under the DHT process (an "[ERROR] ... use of closed network connection" line, then a
# shutdown stalled until hivemind's grace period ran out); out of that group it is stopped by hivemind alone.
_LAUNCHER = """import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("p2pd launcher: prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != int(sys.argv[1]):
    sys.exit("p2pd launcher: the process that started p2pd is gone")
os.setpgid(0, 0)
os.execv(sys.argv[2], sys.argv[2:])
"""


def dies_with_this_process(command: list[str]) -> list[str]:
    """``command`` behind the launcher above: started from this process, it is killed when this process (precisely:
    the thread that starts it) dies."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *command]


# p2pd turns its circuit relay on from a built-in default that ``-relay=0`` (hivemind's ``use_relay=False``) cannot
# turn off; a config file can, the flags keeping their meaning on top of it (go-libp2p-daemon's p2pd/main.go).
RELAY_OFF_CONFIG = Path(__file__).with_name("p2pd_relay_off.json")


def daemon_command(original: Callable[..., list[str]], *args: Any, **options: Any) -> list[str]:
    """hivemind's p2pd command line, with ``use_relay=False`` meaning it (the relay-off config file) and, on Linux,
    behind the launcher that kills the daemon with this process."""
    if options.get("relay") is False and "f" not in options:
        options["f"] = str(RELAY_OFF_CONFIG)
    command = original(*args, **options)
    return dies_with_this_process(command) if sys.platform.startswith("linux") and sys.executable else command


def guard_daemons() -> None:
    """Make every ``p2pd`` that hivemind starts from now on, in this process and in processes forked from it, die
    with the process that started it (Linux), and run without a circuit relay when started with
    ``use_relay=False`` (:data:`RELAY_OFF_CONFIG`). Idempotent.

    A p2pd whose parent died also dies of SIGPIPE at its next line of log, as nobody reads its output any more,
    but only if it writes one; the death signal does not depend on that. hivemind 1.1.12 starts p2pd with
    ``asyncio.create_subprocess_exec`` and has no hook for the child, but it builds the command line in one
    place, ``P2P._make_process_args``: that is wrapped (:func:`daemon_command`). Code that calls
    ``hivemind.P2P.create`` itself should call this first.
    """
    original = P2P._make_process_args
    if getattr(original, "guarded", False):
        return
    wrapped = partial(daemon_command, original)
    wrapped.guarded = True
    P2P._make_process_args = staticmethod(wrapped)


def before_a_daemon_starts() -> None:
    """What every start of a libp2p daemon from this project goes through: the daemon dies with this process
    (:func:`guard_daemons`), and the socket files of peers killed before are removed now and then (hivemind removes
    its own only in its shutdown: ``swarm.dht.sockets``)."""
    guard_daemons()
    remove_dead_sockets_now_and_then()


async def create_p2p(initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = LOOPBACK_MADDRS) -> P2P:
    """A bare libp2p peer (hivemind's ``P2P``, no DHT), started as :func:`start_dht` starts one: its daemon dies with
    this process and runs a circuit relay only where one can help (:func:`swarm.dht.nat.relay_wanted`)."""
    before_a_daemon_starts()
    return await P2P.create(initial_peers=list(initial_peers) or None, host_maddrs=list(host_maddrs),
                            use_relay=relay_wanted(None, host_maddrs, initial_peers))


def follow_parent(parent_pid: int, started_by_main_thread: bool) -> None:
    """In a child process: exit as soon as ``parent_pid`` is gone.

    With a parent's main thread as starter this is the kernel's death signal. A death signal fires when the
    starting *thread* exits, so a child started from another thread instead polls its parent pid (a thread pool
    may end the starting thread while the process lives on).
    """
    if started_by_main_thread and die_with_parent(parent_pid):
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(ORPHAN_POLL_S)
        logger.warning("the process that started this DHT peer (pid %d) is gone; exiting", parent_pid)
        os._exit(0)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


class WholeMessageReader:
    """The DHT process's end of hivemind's command pipe, read in blocking mode so that a message is read whole.

    hivemind's loop watches the pipe (``add_reader``; uvloop makes the descriptor non-blocking) and reads a message
    once it is readable. A message over 16 KB (a ``store`` of an audit report, a coroutine with its arguments) is
    written in two parts; a reader woken between them got ``BlockingIOError`` for the second, and the next read began
    mid-message: the process died unpickling it, and every later call of its owner waited forever (seen under load).
    Only ``recv`` changes: the wait is for the rest of a message already begun.
    """

    def __init__(self, connection: Any):
        self._connection = connection

    def recv(self) -> Any:
        descriptor = self._connection.fileno()
        was_blocking = os.get_blocking(descriptor)
        os.set_blocking(descriptor, True)
        try:
            return self._connection.recv()
        finally:
            os.set_blocking(descriptor, was_blocking)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


class GuardedDHT(DHT):
    """hivemind's DHT process, which exits when the process that started it is gone, however it died, and reads
    each command whole (:class:`WholeMessageReader`)."""

    def __init__(self, *args, **kwargs):
        self.starter_pid = os.getpid()
        self.started_by_main_thread = threading.current_thread() is threading.main_thread()
        super().__init__(*args, **kwargs)  # forks here with start=True

    def run(self) -> None:
        follow_parent(self.starter_pid, self.started_by_main_thread)
        self._inner_pipe = WholeMessageReader(self._inner_pipe)
        super().run()

    _replica_lock = threading.Lock()  # held for a few lines, never across an await (callers on other loops wait)

    async def replicate_p2p(self) -> P2P:
        """hivemind's one replica per DHT object and process, made safe for callers at once: hivemind's checks for
        a cached replica, then awaits its creation, so callers at once each made one and all but the last were
        orphaned (checked: ``asyncio.gather`` of two calls got two replicas). An orphan's handlers and socket are
        removed whenever the collector reaches it (``P2P.__del__``), and a stream routed to them is reset with nothing
        read. Here the first caller creates it and the others, on any event loop, wait for it."""
        pid = os.getpid()
        with GuardedDHT._replica_lock:
            if self._p2p_replica is not None and self._origin_pid == pid:
                return self._p2p_replica
            pending = getattr(self, "_replica_pending", None)
            creating = pending is None or pending[0] != pid or pending[1].done()
            if creating:
                pending = self._replica_pending = (pid, concurrent.futures.Future())
        future = pending[1]
        if not creating:
            return await asyncio.wrap_future(future)
        try:
            replica = await super().replicate_p2p()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as error:
            future.set_exception(error)
            raise
        future.set_result(replica)
        return replica


_DAEMON_LOG_PREFIX = re.compile(r"^(Daemon failed to start: )?\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")


def join_error(error: P2PDaemonError, peers: list[str], identity_path: Optional[str]) -> Exception:
    """hivemind's daemon error as the exception a user can act on (what to change, in one line)."""
    message = _DAEMON_LOG_PREFIX.sub("", str(error)).strip()
    if "failed to connect to bootstrap peers" in message:
        listed = ", ".join(peers[:3]) + (f" and {len(peers) - 3} more" if len(peers) > 3 else "")
        return SwarmJoinError(f"could not reach any initial peer ({listed}): check that the peer runs and that the "
                              "address, port and peer id are the ones it printed")
    if "already taken by another peer" in message:
        return AddressInUseError(f"the identity in {identity_path} is already used by a running peer; stop it or "
                                 "give another --identity-path")
    if "address already in use" in message:
        return AddressInUseError(f"a port to listen on is already in use: {message}")
    if "failed to parse multiaddr" in message:
        return ValueError(f"a multiaddr was refused by the libp2p daemon: {message}")
    return SwarmJoinError(f"could not start the DHT peer: {message}")


# ----- the keys the swarm reads: bounded storage, loud failed replies ------------------------------------
class FailedReplyWarnings:
    """A rate-limited WARNING when a peer's answer to a find for a protected key is lost.

    hivemind drops a peer's failed reply (over the 4 MiB message limit, timed out, peer gone) at debug level and
    goes on with the other peers' answers; a reader must know that one source was lost, so this says so once per
    peer per ``period`` seconds, naming the keys.
    """

    def __init__(self, names: dict[bytes, str], period: float = FAILED_REPLY_WARN_S):
        self.names, self.period = names, period
        self._last: dict[str, float] = {}

    def report(self, peer: Any, key_ids: Iterable[Any]) -> None:
        named = [self.names[k.to_bytes()] for k in key_ids if k.to_bytes() in self.names]
        if not named:
            return
        now, peer = time.monotonic(), str(peer)
        if now - self._last.get(peer, float("-inf")) < self.period:
            return
        self._last[peer] = now
        shown = ", ".join(named[:4]) + ("..." if len(named) > 4 else "")
        logger.warning("DHT peer %s gave no usable reply for %s (over the message size limit, a timeout or gone); "
                       "reading the other peers' replies", peer, shown)


async def _guard_node(dht: DHT, node: DHTNode, policies: dict[bytes, KeyPolicy], trusted: frozenset[str]) -> None:
    """In the DHT process: keep every key readable and only what its policy allows under the swarm's keys (those
    listed, and those whose values name a declared key: ``swarm.dht.keys``), and warn of lost replies."""
    protect_storage([node.protocol.storage, node.protocol.cache], policies, partial(policy_for, trusted=trusted))
    warnings = FailedReplyWarnings({key_id: policy.name for key_id, policy in policies.items()})
    original = node.protocol.call_find

    async def call_find(peer, keys):
        keys = list(keys)
        reply = await original(peer, keys)
        if reply is None:
            warnings.report(peer, keys)
            return reply
        return {key: _as_policy_allows(node.protocol.storage, key, found, nearest) for key, (found, nearest)
                in reply.items()}

    node.protocol.call_find = call_find
    await _name_store_senders(node)


def _as_policy_allows(storage: ProtectedStorage, key: DHTID, found: Any, nearest: Any) -> tuple[Any, Any]:
    """A peer's answer for one key, without a regular value where the key's policy is known: hivemind's search
    keeps the answer that expires last, so one peer answering a regular value that expires in a year would replace
    every other peer's records of a key the swarm reads (its entries are merged only with other dictionaries)."""
    if found is not None and not isinstance(found.value, DictionaryDHTValue) and storage.policy_of(key.to_bytes()):
        logger.debug("ignoring a regular value in a reply for %s", storage.policy_of(key.to_bytes()).name)
        return None, nearest
    return found, nearest


async def _name_store_senders(node: DHTNode) -> None:
    """Serve DHT stores through a handler that names the sending peer to the protected storage (``STORE_SENDER``).

    hivemind registers its bound ``rpc_store`` with the daemon when the node starts; this registers, under the
    same protocol name, a handler that sets the sender for the duration of that call and then runs hivemind's.
    """
    protocol = node.protocol
    if protocol.client_mode:
        return  # a client-mode peer serves no DHT requests: there is no handler to replace
    name = DHTProtocol._get_handle_name(None, "rpc_store")
    serve = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer).rpc_store

    async def rpc_store(request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        token = STORE_SENDER.set(context.remote_id.to_base58())
        try:
            return await serve(request, context)
        finally:
            STORE_SENDER.reset(token)

    await protocol.p2p.remove_protobuf_handler(name)
    await protocol.p2p.add_protobuf_handler(name, rpc_store, dht_pb2.StoreRequest)


# ----- starting and stopping ---------------------------------------------------------------------------
def start_dht(network: NetworkConfig, record_validators: Iterable[RecordValidatorBase] = (),
              identity: Optional[Identity] = None, protect: Iterable[KeyPolicy] = ()) -> DHT:
    """Start a DHT peer (with its libp2p daemon) and wait until it is ready.

    Raises ValueError for a malformed multiaddr, :class:`AddressInUseError` for a port or identity in use and
    :class:`SwarmJoinError` when no initial peer can be reached, each with a message saying what to change. The
    peer's processes die with this one (see the module's docstring).

    Every peer runs the swarm's record validators (``swarm.dht.validation``) and hivemind's
    ``RSASignatureValidator``, so storing peers refuse forged writes and readers strip the signatures. With an
    ``identity`` the daemon runs with that key and records are signed with it (what servers do); a temporary
    identity file is removed once the daemon has read it.

    Every key this peer stores stays small enough for a reply to carry it (``swarm.dht.validation.MAX_KEY_BYTES``).
    ``protect`` lists the swarm's keys this process knows (``swarm.dht.schema.protected_keys``): it refuses to
    store what no reader would use under them, bounds their subkeys, and warns when a peer's reply for one is lost.
    """
    protect = list(protect)
    policies = {dht_key_id(policy.name): policy for policy in protect}
    validators = [identity.validator] if identity is not None else []  # the first RSA validator is the one used
    validators += [*record_validators, *swarm_validators()]
    if not any(isinstance(v, RSASignatureValidator) for v in validators):
        validators.append(RSASignatureValidator())
    peers = resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers)
    host_maddrs = listen_addresses(network.host_maddrs, LOOPBACK_MADDRS, peers)
    check_listen_addresses(host_maddrs)
    before_a_daemon_starts()
    use_relay = relay_wanted(network.use_relay, host_maddrs, peers)
    kwargs = dict(
        host_maddrs=host_maddrs, use_relay=use_relay, use_auto_relay=network.use_auto_relay,
        client_mode=network.client_mode,
    )
    if network.announce_maddrs:
        kwargs["announce_maddrs"] = network.announce_maddrs
    relays = relay_plan(host_maddrs, network.announce_maddrs, peers, use_relay=use_relay,
                        use_auto_relay=network.use_auto_relay, client_mode=network.client_mode)
    if relays is not None:
        logger.info("reachable through relays only (%s): relays %s", relays.reason, ", ".join(relays.relays) or "?")
        kwargs.update(relays.daemon_options())
    if identity is not None:
        kwargs["identity_path"] = str(identity.path)
        kwargs["check_if_identity_free"] = not identity.fresh  # a key made a moment ago cannot be in use
    elif network.identity_path:
        kwargs["identity_path"] = network.identity_path
    logger.info("starting DHT peer (%d initial peers)", len(peers))
    try:
        dht = GuardedDHT(initial_peers=peers or None, start=True, record_validators=validators, **kwargs)
    except P2PDaemonError as error:
        raise join_error(error, peers, kwargs.get("identity_path")) from error
    finally:
        if identity is not None:
            identity.remove()
    if identity is not None and str(dht.peer_id) != identity.peer_id:
        stop_dht(dht)
        raise RuntimeError(f"the DHT runs as {dht.peer_id}, not as its identity {identity.peer_id}")
    # with no policies it still bounds every key, and learns the policy of every key whose values name it
    dht.run_coroutine(partial(_guard_node, policies=policies, trusted=trusted_keys(protect)))
    if relays is not None and relays.detected:
        report_relay(dht, network.relay_wait)
    return dht


def report_relay(dht: DHT, timeout: float) -> list[str]:
    """Wait (up to ``timeout`` s) until the daemon holds a relay reservation, so that the addresses a server then
    announces include its ``/p2p-circuit`` ones; say how long it took, or that the peer is unreachable so far."""
    found, waited = wait_for_relay(lambda: dht.get_visible_maddrs(latest=True), timeout)
    if found:
        logger.info("reachable through %s after %.1f s: %s", plural(len(found), "relay"), waited, ", ".join(found))
    else:
        logger.warning("no relay reservation after %.0f s: other peers cannot reach this one yet (libp2p waits up to "
                       "3 min for relays when it knows fewer than 4 public peers; list more --initial-peers)", waited)
    return found


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


def close_replica(dht: DHT, timeout: float = 5.0) -> None:
    """Close the P2P replica that ``dht.replicate_p2p()`` cached in this process (the clients' connection to the
    peer's daemon), on the event loop it runs on, before the peer stops.

    Dropped open, the replica's persistent-connection tasks and its control client form a garbage cycle; when the
    collector breaks it, asyncio logs "Task was destroyed but it is pending!" and hivemind's ``ControlClient.__del__``
    raises in whatever thread collected it (no event loop there). Collected in the middle of an import, that once
    stopped a test with CPython 3.11's "AST constructor recursion depth mismatch" (issue 56)."""
    replica = getattr(dht, "_p2p_replica", None)  # hivemind 1.1.12 caches one replica per DHT object and process
    if replica is None or getattr(dht, "_origin_pid", None) != os.getpid():
        return
    dht._p2p_replica = None
    control = getattr(getattr(replica, "_client", None), "control", None)
    tasks = [getattr(control, name, None) for name in ("_read_task", "_write_task")]
    loops = {task.get_loop() for task in tasks if task is not None and not task.done()}
    try:
        calling = asyncio.get_running_loop()
    except RuntimeError:
        calling = None
    for loop in loops:
        try:
            if loop is calling:  # its own thread (a server's shutdown) cannot wait for itself: the synchronous part
                replica._terminate()  # of P2P.shutdown (a replica has no daemon to wait for) removes its socket too
            elif loop.is_running() and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(replica.shutdown(), loop).result(timeout)
        except Exception as error:  # the peer is stopping anyway
            logger.debug("closing the P2P replica failed: %s", error)


def stop_dht(dht: DHT, timeout: float = 5.0) -> None:
    """Shut a DHT peer down, and make sure its process (and so its libp2p daemon) is really gone; this process's
    connection to its daemon is closed first (:func:`close_replica`)."""
    close_replica(dht, timeout)
    try:
        dht.shutdown()
    except Exception as error:  # shutting down a half-dead peer must not stop the rest of the cleanup
        logger.warning("DHT shutdown failed: %s", error)
    if dht.is_alive():
        dht.join(timeout)
    if dht.is_alive():
        logger.warning("DHT process did not stop in %.0f s; terminating it", timeout)
        dht.terminate()
        dht.join(timeout)
