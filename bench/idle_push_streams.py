"""What open, idle push streams cost their sender in CPU: N `arceus.wire.push_stream.PushStream`s to one in-process
gRPC server that acks every push, each pushed to once, then this process's CPU and voluntary context switches over
`--seconds` of nothing sent. An agent keeps one stream per neighbour replica it sends to (36 in all at 3 replicas
of 3 stages, 4 at one), open between steps and between its pushes within one.

    .venv/bin/python bench/idle_push_streams.py [--streams 36] [--seconds 5]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from arceus.v1 import stage_pb2, stage_pb2_grpc  # noqa: E402
from arceus.wire import codec  # noqa: E402
from arceus.wire.push_stream import PushStream, raw_push  # noqa: E402


class Acks(stage_pb2_grpc.StageServiceServicer):
    def PushStream(self, request_iterator: Iterator[stage_pb2.PushTensorRequest],  # noqa: N802 (gRPC's name)
                   context: grpc.ServicerContext) -> Iterator[stage_pb2.PushAck]:
        for request in request_iterator:
            yield stage_pb2.PushAck(kind=request.kind, step=request.step, micro_batch=request.micro_batch)


def idle_cost(streams: int, seconds: float) -> tuple[float, float]:
    """CPU seconds per second and voluntary context switches per second of this process with `streams` idle."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 4))
    stage_pb2_grpc.add_StageServiceServicer_to_server(Acks(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    pushes = [PushStream(channel) for _ in range(streams)]
    try:
        dtype, shape, data = codec.encode(torch.zeros(2, 4))
        ref = stage_pb2.StageRef(job_id="idle", stage_index=0, generation=1)
        for stream in pushes:
            stream.push(raw_push(ref, stage_pb2.ACTIVATION, 1, 0, dtype, shape, data), timeout=10).result(timeout=10)
        time.sleep(0.5)  # the calls' own start-up settles
        before, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        time.sleep(seconds)
        after, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - cpu
    finally:
        for stream in pushes:
            stream.close()
        channel.close()
        server.stop(0)
    return cpu / seconds, (after.ru_nvcsw - before.ru_nvcsw) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=36)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    cpu, switches = idle_cost(args.streams, args.seconds)
    print(f"{args.streams} idle push streams: {cpu * 1000:.1f} ms of CPU per second, {switches:.0f} voluntary context "
          f"switches per second")


if __name__ == "__main__":
    main()
