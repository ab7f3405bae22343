"""What one replica's gradient exchange costs in CPU per byte on this machine, for the step model's shared host
(`arceus.swarm.model.SharedHost.exchange_cpu_per_byte`, bench/swarm_scaling.py).

R `nodeagent.replicas.ReplicaExchange`s in this process, each behind a gRPC server with TLS on loopback that parses
the shards it receives and hands them to `accept` as an agent's ReplicaService does (`add_replica_service`), exchange
a vector of a stage's size at once (one thread each), over the same TLS channels the agents open
(`arceus.wire.channels.open_channel`), with the agent's malloc settings (`nodeagent.heap.retain_freed_blocks`). The
cost is this process's CPU (every thread: the exchanges, gRPC's own) over the bytes every replica sent and received.

    .venv/bin/python bench/exchange_cost.py [--elements 1600000] [--replicas 2] [--rounds 6]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from arceus.contracts.credentials import REPLICA_METADATA_KEY, token_digest  # noqa: E402
from arceus.swarm.exchange import MAX_SHARD_BYTES  # noqa: E402
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2  # noqa: E402
from arceus.wire.channels import grpc_channel_options, open_channel  # noqa: E402
from arceus.wire.incoming_push import IncomingPush, MalformedPush  # noqa: E402
from devtools.launch import free_ports  # noqa: E402
from devtools.pipeline import identity_for  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402
from nodeagent.replica_servicer import add_replica_service  # noqa: E402
from nodeagent.replicas import ReplicaExchange, push_shard_call  # noqa: E402

_MESSAGE_BYTES = 2 * MAX_SHARD_BYTES


class _Link:
    """What the exchange sends through to a sibling (nodeagent.stage.NeighbourLink's PushShard)."""

    def __init__(self, push_shard: grpc.UnaryUnaryMultiCallable) -> None:
        self.push_shard = push_shard


class _Sink(replica_pb2_grpc.ReplicaServiceServicer):
    """A replica's PushShard, as the agent's servicer calls it: the sender's token digest, then `accept`."""

    def __init__(self, exchange: ReplicaExchange) -> None:
        self.exchange = exchange

    def PushShard(  # noqa: N802 (gRPC's name)
        self, request: IncomingPush[replica_pb2.PushShardRequest] | MalformedPush, context: grpc.ServicerContext
    ) -> replica_pb2.PushShardReply:
        token = dict(context.invocation_metadata()).get(REPLICA_METADATA_KEY)
        self.exchange.accept(request, None if token is None else token_digest(token), wait=0.0)
        return replica_pb2.PushShardReply()


def exchange_cpu_per_byte(elements: int, replicas: int = 2, rounds: int = 6) -> float:
    """CPU seconds per byte a replica sends or receives in an exchange of `elements` float32 among `replicas`,
    over `rounds` exchanges after one not timed."""
    if replicas < 2 or elements < replicas or rounds < 1:
        raise ValueError(f"need replicas >= 2, elements >= replicas and rounds >= 1, got {replicas}, {elements}, "
                         f"{rounds}")
    addresses = [f"127.0.0.1:{port}" for port in free_ports(replicas)]
    tokens = [f"{k:064x}" for k in range(1, replicas + 1)]
    exchanges = [
        ReplicaExchange(job_id="exchange-cost", stage_index=0, generation=1, replica=k, token=tokens[k],
                        total_elements=elements, max_replicas=replicas)
        for k in range(replicas)
    ]
    peers = [stage_pb2.ReplicaPeer(stage_index=0, replica=k, token_digest=token_digest(t))
             for k, t in enumerate(tokens)]
    servers, channels = [], []
    try:
        for k, address in enumerate(addresses):
            exchanges[k].members.learn(0, peers)
            server = grpc.server(ThreadPoolExecutor(max_workers=8), options=grpc_channel_options(_MESSAGE_BYTES))
            add_replica_service(_Sink(exchanges[k]), server)
            identity = identity_for(address)
            credentials = grpc.ssl_server_credentials([(identity.key_pem, identity.certificate_pem)])
            server.add_secure_port(address, credentials)
            server.start()
            servers.append(server)
        links = []
        for _ in range(replicas):
            opened = {j: open_channel(a, token="exchange-cost", certificate=identity_for(a).certificate,
                                      max_message_bytes=_MESSAGE_BYTES) for j, a in enumerate(addresses)}
            channels += opened.values()
            links.append({j: _Link(push_shard_call(c)) for j, c in opened.items()})
        vectors = [torch.randn(elements, generator=torch.Generator().manual_seed(k)) for k in range(replicas)]

        def one_round(step: int) -> None:
            errors: list[BaseException] = []

            def run(k: int) -> None:
                try:
                    exchanges[k].exchange(vectors[k], step=step, epoch=0, members=tuple(range(replicas)),
                                          link=lambda j: links[k][j], deadline=time.monotonic() + 120,
                                          abort=threading.Event())
                except BaseException as exc:  # noqa: BLE001 (re-raised below, in this thread)
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(k,)) for k in range(replicas)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]

        one_round(0)  # connections, TLS handshakes, first allocations
        before = time.process_time()
        for step in range(1, rounds + 1):
            one_round(step)
        cpu = time.process_time() - before
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop(None)
        for exchange in exchanges:
            exchange.close()
    sent = 2 * (replicas - 1) / replicas * 4 * elements  # each replica's, over both phases; as much received
    return cpu / (rounds * replicas * 2 * sent)


def agent_exchange_cpu_per_byte(elements: int, replicas: int = 2, rounds: int = 6) -> float:
    """`exchange_cpu_per_byte` in a fresh process set up as an agent is: one torch thread, the agent's malloc
    settings (which must be made before its threads allocate)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_as_agent, elements, replicas, rounds).result()


def _as_agent(elements: int, replicas: int, rounds: int) -> float:
    torch.set_num_threads(1)
    if not retain_freed_blocks():
        raise RuntimeError("the agent's malloc settings did not take (glibc on Linux, no MALLOC_ or GLIBC_TUNABLES "
                           "settings of the operator's): this would time another allocator than the agents'")
    return exchange_cpu_per_byte(elements, replicas, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1_600_000, help="float32 values exchanged (a stage's size)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    cost = agent_exchange_cpu_per_byte(args.elements, args.replicas, args.rounds)
    print(f"{cost * 1e9:.2f} ns of CPU per byte sent or received ({args.replicas} replicas, {args.elements:,} values)")


if __name__ == "__main__":
    main()
