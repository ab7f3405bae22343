"""`python -m arceus.relay --listen HOST:PORT`: a relay. Its secret comes from ARCEUS_RELAY_SECRET (the one the
control plane has; never on the command line, where `ps` shows it). Prints `RELAY READY address=<host:port>`
once it serves; stops on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from arceus.relay.server import RelayServicer, server_options
from arceus.relay.tickets import check_secret
from arceus.v1 import relay_pb2, relay_pb2_grpc

SECRET_ENV = "ARCEUS_RELAY_SECRET"


async def serve(listen: str, secret: bytes) -> None:
    server = grpc.aio.server(options=server_options())
    relay_pb2_grpc.add_RelayServiceServicer_to_server(RelayServicer(secret), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port(listen)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        secret = check_secret(os.environ.get(SECRET_ENV, "").encode())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.listen, secret))
    return 0


if __name__ == "__main__":
    sys.exit(main())
