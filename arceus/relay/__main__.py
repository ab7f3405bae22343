"""`python -m arceus.relay --listen HOST:PORT --tls-key KEY --tls-cert CERT`: a relay, serving TLS only, as the
identity in those files (made once with `--new-identity`; the control plane's ARCEUS_RELAY_CERTIFICATE_FILE is the
same certificate, which agents and callers pin). Its secret comes from ARCEUS_RELAY_SECRET (the one the control
plane has; never on the command line, where `ps` shows it). Prints `RELAY READY address=<host:port>` once it
serves; stops on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from arceus.contracts.certificates import RELAY_TLS_NAME, check_certificate
from arceus.relay.server import RelayServicer, server_options
from arceus.relay.tickets import check_secret
from arceus.v1 import relay_pb2, relay_pb2_grpc
from arceus.wire.tls import TlsIdentity, load_identity, new_identity

SECRET_ENV = "ARCEUS_RELAY_SECRET"


async def serve(listen: str, secret: bytes, identity: TlsIdentity) -> None:
    server = grpc.aio.server(options=server_options())
    relay_pb2_grpc.add_RelayServiceServicer_to_server(RelayServicer(secret), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_secure_port(listen, grpc.ssl_server_credentials([(identity.key_pem, identity.certificate_pem)]))
    await server.start()
    service = relay_pb2.DESCRIPTOR.services_by_name["RelayService"].full_name
    await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"RELAY READY address={listen.rpartition(':')[0]}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arceus.relay", description=__doc__)
    parser.add_argument("--listen", default="0.0.0.0:7450", help="HOST:PORT to serve on (port 0: a free one)")
    parser.add_argument("--tls-key", type=Path, required=True, help="the relay's private key (PEM)")
    parser.add_argument("--tls-cert", type=Path, required=True,
                        help="the relay's certificate (PEM): the control plane's ARCEUS_RELAY_CERTIFICATE_FILE")
    parser.add_argument("--new-identity", action="store_true",
                        help="write a new key and self-signed certificate to --tls-key and --tls-cert, then exit")
    args = parser.parse_args(argv)
    if args.new_identity:
        return _write_identity(args.tls_key, args.tls_cert)
    try:
        identity = load_identity(args.tls_key.read_bytes(), args.tls_cert.read_bytes())
        check_certificate(identity.certificate, RELAY_TLS_NAME)
    except (OSError, ValueError) as exc:
        print(f"error: --tls-key/--tls-cert: {exc} (make them with --new-identity)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        secret = check_secret(os.environ.get(SECRET_ENV, "").encode())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.listen, secret, identity))
    return 0


def _write_identity(key_path: Path, cert_path: Path) -> int:
    if key_path.exists() or cert_path.exists():
        print(f"error: {key_path} or {cert_path} exists; a relay's identity is never overwritten", file=sys.stderr)
        return 2
    identity = new_identity(RELAY_TLS_NAME)
    key_path.touch(mode=0o600)
    key_path.write_bytes(identity.key_pem)
    cert_path.write_bytes(identity.certificate_pem)
    print(f"wrote {key_path} and {cert_path}: give the control plane ARCEUS_RELAY_CERTIFICATE_FILE={cert_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
