"""Finding a control plane on the local network: mDNS/DNS-SD (python-zeroconf).

The control plane is advertised as a `_arceus._tcp.local.` service whose TXT record `url` is its base URL
(`python -m arceus.discovery advertise --url URL`, one small process beside the web servers: it needs no
Django). The SDK (`discovery_method="auto"`) and an agent started without `--control-plane` browse for it.

Anyone on the network can advertise, so what is found is checked like any input (an http(s) base URL, bounded),
and the URL found is always logged or returned for the user to see: use discovery on a network you trust, and a
configured URL (with https) anywhere else.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from zeroconf import ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

log = logging.getLogger("arceus.discovery")

SERVICE_TYPE = "_arceus._tcp.local."
URL_PROPERTY = b"url"
MAX_URL_CHARS = 2048
DEFAULT_BROWSE_SECONDS = 3.0
# After the first answer, how long to keep listening for others (two control planes on one network is an error).
SETTLE_SECONDS = 0.5
ADVERTISING_PREFIX = "ADVERTISING"


class DiscoveryError(RuntimeError):
    """No control plane was found (or more than one); the message says what was tried and how to fix it."""


@dataclass(frozen=True)
class Found:
    """A control plane found on the network: its base URL and the service instance that named it."""

    url: str
    service: str


def check_url(url: str) -> str:
    """`url` as a control plane's base URL (http or https, a host, no credentials, query or fragment), without a
    trailing slash; ValueError naming what is wrong."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"a control-plane URL is at most {MAX_URL_CHARS} characters, got {len(url)}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"a control-plane URL starts with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"a control-plane URL names a host, got {url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"a control-plane URL carries no credentials, query or fragment, got {url!r}")
    parts.port  # noqa: B018 -- raises ValueError for a port out of range
    return url.rstrip("/")


def browse(timeout: float = DEFAULT_BROWSE_SECONDS) -> tuple[list[Found], list[str]]:
    """Control planes advertised on the local network: those found within `timeout` seconds (answers are
    awaited `SETTLE_SECONDS` past the first), and why each advertisement that was skipped was (a bad URL)."""
    found: dict[str, Found] = {}
    skipped: list[str] = []
    names: list[str] = []
    first = threading.Event()
    lock = threading.Lock()

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            with lock:
                if name not in names:
                    names.append(name)
            first.set()

        update_service = add_service

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass  # a control plane leaving during a few seconds' browse: its URL simply fails to answer later

    zc = Zeroconf()
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, Listener())
        deadline = time.monotonic() + timeout
        if first.wait(timeout):
            time.sleep(max(0.0, min(SETTLE_SECONDS, deadline - time.monotonic())))
        browser.cancel()
        with lock:
            seen = list(names)
        for name in seen:
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=int(max(1.0, deadline - time.monotonic()) * 1000))
            if info is None:
                skipped.append(f"{name}: did not answer with its TXT record")
                continue
            raw = (info.properties or {}).get(URL_PROPERTY)
            try:
                url = check_url(raw.decode("utf-8") if isinstance(raw, bytes) else "")
            except (ValueError, UnicodeDecodeError) as exc:
                skipped.append(f"{name}: {exc}")
                continue
            found.setdefault(url, Found(url=url, service=name))
    finally:
        zc.close()
    return sorted(found.values(), key=lambda f: f.url), skipped


def discover_control_plane(timeout: float = DEFAULT_BROWSE_SECONDS) -> Found:
    """The one control plane advertised on the local network; DiscoveryError if none or several are."""
    found, skipped = browse(timeout)
    if len(found) == 1:
        return found[0]
    if found:
        urls = ", ".join(f.url for f in found)
        raise DiscoveryError(f"{len(found)} control planes advertise {SERVICE_TYPE} on this network ({urls}); "
                             "name the one you mean with its URL")
    reasons = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    raise DiscoveryError(
        f"no control plane answered an mDNS query for {SERVICE_TYPE} within {timeout:g}s{reasons}. Is "
        "`python -m arceus.discovery advertise --url URL` running on the control plane's network, and does "
        "multicast reach this machine (same subnet, UDP 5353 allowed)? Or give the control plane's URL"
    )


DISCOVERY_METHODS = ("auto", "mdns", "url")


def control_plane_url(method: str, *, given: str | None, configured: str | None, configured_by: str,
                      timeout: float = DEFAULT_BROWSE_SECONDS) -> Found:
    """The control plane to use. `given`: a URL passed explicitly; `configured`: one from the environment
    (`configured_by` names where, for errors). `method` "url": given, else configured; "mdns": the one advertised
    on the local network; "auto": given, else configured, else the local network's. A URL someone configured
    wins over discovery, whose answers anyone on the network can forge (docs/security.md). DiscoveryError saying
    what was tried when nothing is found; ValueError for a method or URL that is not one."""
    if method not in DISCOVERY_METHODS:
        raise ValueError(f"discovery_method must be one of {', '.join(DISCOVERY_METHODS)}, got {method!r}")
    if given:
        return Found(url=check_url(given), service="given")
    if method != "mdns" and configured:
        return Found(url=check_url(configured), service=configured_by)
    if method == "url":
        raise DiscoveryError(f"no control-plane URL: pass url=..., set {configured_by}, or discover one on "
                             "the local network with discovery_method=\"auto\"")
    try:
        return discover_control_plane(timeout)
    except DiscoveryError as exc:
        raise DiscoveryError(f"{exc}: pass url=... or set {configured_by}") from None


def _addresses(url: str, given: Sequence[str]) -> list[bytes]:
    """The IP addresses the advertisement names (packed): `given`, else the URL's host as it resolves here."""
    host = urlsplit(url).hostname or ""
    names = list(given) or sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    return [ipaddress.ip_address(name).packed for name in names]


@contextmanager
def advertising(url: str, *, name: str | None = None, addresses: Sequence[str] = (),
                interfaces: Sequence[str] | None = None) -> Iterator[ServiceInfo]:
    """Advertise the control plane at `url` while the block runs. `name`: the service instance (default: this
    host's name); `addresses`: the IPs to announce (default: the URL's host's); `interfaces`: the local addresses
    to announce on (default: every interface)."""
    url = check_url(url)
    parts = urlsplit(url)
    instance = (name or socket.gethostname()).replace(".", "-")[:63]
    info = ServiceInfo(
        SERVICE_TYPE, f"{instance}.{SERVICE_TYPE}",
        addresses=_addresses(url, addresses),
        port=parts.port or (443 if parts.scheme == "https" else 80),
        properties={URL_PROPERTY: url.encode("utf-8")},
        server=f"{instance}.local.",
    )
    zc = Zeroconf(interfaces=list(interfaces)) if interfaces else Zeroconf()
    try:
        zc.register_service(info)
        try:
            yield info
        finally:
            zc.unregister_service(info)
    finally:
        zc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m arceus.discovery",
        description="Advertise a control plane on the local network (mDNS/DNS-SD), or look for one.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    advertise = sub.add_parser("advertise", help="advertise until SIGTERM/SIGINT; prints one ADVERTISING line")
    advertise.add_argument("--url", default=os.environ.get("ARCEUS_PUBLIC_URL"),
                           help="the base URL agents and developers reach ($ARCEUS_PUBLIC_URL)")
    advertise.add_argument("--name", help="service instance name (default: this host's name)")
    advertise.add_argument("--address", action="append", default=[],
                           help="IP to announce (repeatable; default: the URL's host's)")
    advertise.add_argument("--interface", action="append",
                           help="local address to announce on (repeatable; default: every interface)")
    find = sub.add_parser("find", help="print the control planes advertised on the local network")
    find.add_argument("--timeout", type=float, default=DEFAULT_BROWSE_SECONDS)
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "find":
        found, skipped = browse(args.timeout)
        for reason in skipped:
            log.warning("skipped %s", reason)
        for item in found:
            print(f"{item.url} {item.service}")
        return 0 if found else 1
    if not args.url:
        parser.error("no URL to advertise: give --url or set ARCEUS_PUBLIC_URL")
    try:
        check_url(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with advertising(args.url, name=args.name, addresses=args.address, interfaces=args.interface) as info:
        print(f"{ADVERTISING_PREFIX} url={check_url(args.url)} service={info.name}", flush=True)
        while not stop.wait(0.2):
            pass
    log.info("stopped advertising")
    return 0


if __name__ == "__main__":
    sys.exit(main())
