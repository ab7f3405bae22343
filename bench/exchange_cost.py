"""What one replica's gradient exchange costs in CPU per byte on this machine, for the step model's shared host
(`arceus.swarm.model.SharedHost.exchange_cpu_per_byte`, bench/swarm_scaling.py).

R `nodeagent.replicas.ReplicaExchange`s in this process, each with its own `nodeagent.peer_streams.PeerStreams`
(an agent's: its TLS identity and a listener on loopback handing streams to the replica, as an agent's registry
does), exchange a vector of a stage's size at once (one thread each), over the mutual-TLS streams agents open, with
the agent's malloc settings (`nodeagent.heap.retain_freed_blocks`). The cost is this process's CPU (every thread:
the exchanges and the listeners) over the bytes every replica sent and received.

    .venv/bin/python bench/exchange_cost.py [--elements 1600000] [--replicas 2] [--rounds 6]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from arceus.contracts.credentials import token_digest  # noqa: E402
from arceus.v1 import stage_pb2  # noqa: E402
from arceus.wire.tls import new_identity  # noqa: E402
from nodeagent.exchange_stream import exchange_hellos  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402
from nodeagent.peer_streams import PeerStreams  # noqa: E402
from nodeagent.replicas import ReplicaExchange  # noqa: E402


def exchange_cpu_per_byte(elements: int, replicas: int = 2, rounds: int = 6) -> float:
    """CPU seconds per byte a replica sends or receives in an exchange of `elements` float32 among `replicas`,
    over `rounds` exchanges after one not timed."""
    if replicas < 2 or elements < replicas or rounds < 1:
        raise ValueError(f"need replicas >= 2, elements >= replicas and rounds >= 1, got {replicas}, {elements}, "
                         f"{rounds}")
    tokens = [f"{k:064x}" for k in range(1, replicas + 1)]
    identities = [new_identity() for _ in range(replicas)]
    wires = [PeerStreams(identity) for identity in identities]
    exchanges = [
        ReplicaExchange(job_id="exchange-cost", stage_index=0, generation=1, replica=k, token=tokens[k],
                        total_elements=elements, max_replicas=replicas, streams=wires[k])
        for k in range(replicas)
    ]
    peers = {k: stage_pb2.ReplicaPeer(stage_index=0, replica=k, address="127.0.0.1:1", token_digest=token_digest(t),
                                      certificate=identities[k].certificate)
             for k, t in enumerate(tokens)}
    try:
        for k in range(replicas):
            wires[k].listen("127.0.0.1",
                            exchange_hellos(lambda hello, sock: exchanges[hello.target].offer(hello, sock)))
            exchanges[k].learn(0, peers.values())
        vectors = [torch.randn(elements, generator=torch.Generator().manual_seed(k)) for k in range(replicas)]

        def one_round(step: int) -> None:
            errors: list[BaseException] = []

            def run(k: int) -> None:
                try:
                    exchanges[k].exchange(vectors[k], step=step, epoch=0, members=tuple(range(replicas)),
                                          peers={j: p for j, p in peers.items() if j != k},
                                          port_of=lambda j: wires[j].port, deadline=time.monotonic() + 120,
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
        for exchange in exchanges:
            exchange.close()
        for wire in wires:
            wire.close()
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
