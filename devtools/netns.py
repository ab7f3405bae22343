"""Network namespaces standing for other machines. `NetworkNamespace`: a contributor's home, a veth link to this
machine whose inbound connections are dropped (iptables in the namespace, as a home router's NAT drops them).
`Lan`: machines on one local network, each namespace's veth joined to a bridge of this machine, multicast
(mDNS) flowing between them and nowhere else. In either, chosen loopback ports of this machine are reachable
inside the namespace (`bridge`): its way to the control plane, relays and directly dialled agents, or to the
database and broker of a control plane run inside it. Linux only, as root (`ip`, `iptables`)."""

from __future__ import annotations

import contextlib
import ctypes
import socket
import subprocess
import threading
from collections.abc import Sequence

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class _Namespace:
    """A namespace by name: commands run in it, this machine's loopback ports bridged into it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: list[socket.socket] = []
        _run("ip", "netns", "add", name)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def bridge(self, port: int, listen_address: str = "127.0.0.1") -> None:
        """Make this machine's 127.0.0.1:`port` reachable at `listen_address`:`port` inside the namespace."""
        listener = self._listen_inside(listen_address, port)
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def _listen_inside(self, address: str, port: int) -> socket.socket:
        """A listening socket in the namespace's network stack (made on a thread of its own that enters it)."""
        made: list[socket.socket | BaseException] = []

        def enter_and_listen() -> None:
            with open(f"/run/netns/{self.name}") as target:
                if _libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                    made.append(OSError(ctypes.get_errno(), f"setns into {self.name} failed"))
                    return
            try:
                made.append(socket.create_server((address, port)))
            except OSError as exc:
                made.append(exc)

        thread = threading.Thread(target=enter_and_listen)  # the thread ends in the namespace, and with it that
        thread.start()
        thread.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    @staticmethod
    def _accept(listener: socket.socket, port: int) -> None:
        while True:
            try:
                inside, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                outside = socket.create_connection(("127.0.0.1", port), timeout=5)
                outside.settimeout(None)  # the connection may idle for long (a relay attachment)
            except OSError:
                inside.close()
                continue
            for src, dst in ((inside, outside), (outside, inside)):
                threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


class NetworkNamespace(_Namespace):
    def __init__(self, name: str, subnet: int) -> None:
        """`name`: unique on this machine (at most 11 characters: it names the veth ends too); the link is
        10.<subnet // 256>.<subnet % 256>.0/30, the namespace's end at .2."""
        self._host_if, self._ns_if = f"{name}h", f"{name}n"
        prefix = f"10.{subnet // 256}.{subnet % 256}"
        self.host_address, self.address = f"{prefix}.1", f"{prefix}.2"
        super().__init__(name)
        try:
            _run("ip", "link", "add", self._host_if, "type", "veth", "peer", "name", self._ns_if)
            _run("ip", "link", "set", self._ns_if, "netns", name)
            _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self._host_if)
            _run("ip", "link", "set", self._host_if, "up")
            inside = ("ip", "netns", "exec", name)
            _run(*inside, "ip", "addr", "add", f"{self.address}/30", "dev", self._ns_if)
            _run(*inside, "ip", "link", "set", self._ns_if, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", self.host_address)
            # The home router: no connection comes in over the link, replies to the home's own do.
            _run(*inside, "iptables", "-A", "INPUT", "-i", self._ns_if, "-p", "tcp", "--syn", "-j", "DROP")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self._host_if], capture_output=True, timeout=30)
        super().close()


class Lan:
    """Namespaces on one local network: each one's veth joined to a bridge of this machine (which holds
    10.<subnet // 256>.<subnet % 256>.1/24 and routes to them); namespace i holds .<i + 2>. Multicast is flooded
    between them (no IGMP snooping), so mDNS works across it; it goes to no interface but the bridge's."""

    def __init__(self, name: str, subnet: int, hosts: int) -> None:
        """`name`: unique on this machine (at most 10 characters: it names the bridge and veth ends too)."""
        self._bridge = f"{name}b"
        prefix = f"10.{subnet // 256}.{subnet % 256}"
        self.host_address = f"{prefix}.1"
        self.namespaces: list[_Namespace] = []
        self.addresses: list[str] = []
        _run("ip", "link", "add", self._bridge, "type", "bridge", "mcast_snooping", "0")
        try:
            _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self._bridge)
            _run("ip", "link", "set", self._bridge, "up")
            for i in range(hosts):
                ns = _Namespace(f"{name}{i}")
                self.namespaces.append(ns)
                host_if, ns_if, address = f"{name}{i}h", f"{name}{i}n", f"{prefix}.{i + 2}"
                _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
                _run("ip", "link", "set", ns_if, "netns", ns.name)
                _run("ip", "link", "set", host_if, "master", self._bridge)
                _run("ip", "link", "set", host_if, "up")
                inside = ("ip", "netns", "exec", ns.name)
                _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", ns_if)
                _run(*inside, "ip", "link", "set", ns_if, "up")
                _run(*inside, "ip", "link", "set", "lo", "up")
                self.addresses.append(address)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ns in self.namespaces:
            ns.close()  # its veth goes with it
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True, timeout=30)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

