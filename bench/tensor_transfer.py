"""GB/s moving 4 MB float32 tensors between two processes on loopback: our path vs bare gRPC vs raw TCP.

    .venv/bin/python bench/tensor_transfer.py [--tensors 500] [--rounds 9]

- ours fp32: pushes built by the agent's own code (TransferEncoder -> outgoing_push) from a torch tensor
  (the same one each time, as bare gRPC sends the same bytes; fp32 payloads are views of it, serialized
  straight into the message), sent as the agent sends them (its PushStream on one channel with the agent's channel
  options, a few in flight), into a StageService server registered as the agent registers it (pushes
  parsed by `parse_push`, payloads left in the received bytes) with the agent's server options, whose
  PushStream validates and decodes each tensor with `decode_tensor` (what `decode_push` runs) and acks it.
- ours int8: the same with int8 blockwise transfers (block 64); GB/s counted as fp32-equivalent bytes.
- bare gRPC: one client stream of pre-built raw 4 MB `bytes` messages, no protobuf, no torch: the
  transport alone. grpcio's Python API sends only `bytes`, so a tensor (ours included) is copied into
  each message once; this setup skips that copy.
- bare gRPC, tensor: the same stream, each message `tensor.numpy().tobytes()`: that copy, nothing else.
- raw TCP: the same bytes, length-prefixed, over one socket.
Each server is its own process; every process keeps freed blocks in its heap as an agent does
(nodeagent.heap), so the setups differ only in their code; rounds alternate the five setups. Prints a table, writes
docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.transfer import TransferConfig  # noqa: E402
from arceus.v1 import stage_pb2, stage_pb2_grpc  # noqa: E402
from arceus.wire.channels import grpc_channel_options  # noqa: E402
from arceus.wire.incoming_push import IncomingPush, MalformedPush  # noqa: E402
from arceus.wire.proto_tensor import decode_tensor  # noqa: E402
from arceus.wire.push_stream import PushStream, outgoing_push  # noqa: E402
from arceus.wire.transfer import TransferEncoder  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import free_ports  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402
from nodeagent.servicer import add_stage_service  # noqa: E402

ROWS, COLS = 1024, 1024  # 4 MiB of float32
TENSOR_BYTES = ROWS * COLS * 4
MAX_MESSAGE = 64 * 1024 * 1024
IN_FLIGHT = 4  # pushes the client keeps unacked, as a stage does across its M = 4 micro-batches
BARE_METHOD = "/bench.Bare/Upload"
FRAME = struct.Struct("<Q")


# --- servers (each run in its own process by `--serve`) ---------------------------------------


class DecodingStageServicer(stage_pb2_grpc.StageServiceServicer):
    def PushStream(
        self, request_iterator: Iterator[IncomingPush | MalformedPush], context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.PushAck]:
        for push in request_iterator:
            if isinstance(push, MalformedPush):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, push.reason)
            header = push.header
            decode_tensor(header.tensor, push.data, push.scales, push.indices, max_bytes=TENSOR_BYTES, copy=False)
            yield stage_pb2.PushAck(kind=header.kind, step=header.step, micro_batch=header.micro_batch)


def _grpc_server() -> grpc.Server:
    # The agent's server options (nodeagent/agent.py).
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[*grpc_channel_options(MAX_MESSAGE), ("grpc.so_reuseport", 0)],
    )


def serve_stage(port: int) -> None:
    server = _grpc_server()
    add_stage_service(DecodingStageServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_bare(port: int) -> None:
    def upload(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return FRAME.pack(sum(len(r) for r in requests))

    # No (de)serializers: messages stay raw bytes.
    handler = grpc.method_handlers_generic_handler(
        "bench.Bare", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
    )
    server = _grpc_server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_tcp(port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    buffer = memoryview(bytearray(TENSOR_BYTES))
    while True:
        conn, _ = listener.accept()
        with conn:
            while header := _recv_exact(conn, memoryview(bytearray(FRAME.size))):
                (count,) = FRAME.unpack(header)
                for _ in range(count):
                    _recv_exact(conn, buffer)
                conn.sendall(b"\x01")


def _recv_exact(conn: socket.socket, view: memoryview) -> memoryview | None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view


# --- clients --------------------------------------------------------------------------------------


def run_ours(pushes: PushStream, encoder: TransferEncoder, count: int) -> tuple[float, int]:
    """Seconds to push `count` tensors, and the tensor payload bytes sent."""
    tensor = torch.randn(ROWS, COLS)
    target = stage_pb2.StageRef(job_id="bench", stage_index=1, generation=1)
    pending: list[Future[None]] = []
    sent = 0
    start = time.perf_counter()
    for i in range(count):
        encoded = encoder.encode(tensor, gradient=False, stream=0)
        sent += encoded.nbytes
        pending.append(pushes.push(outgoing_push(target, stage_pb2.ACTIVATION, i, 0, encoded), timeout=30))
        if len(pending) >= IN_FLIGHT:
            pending.pop(0).result()
    for future in pending:
        future.result()
    return time.perf_counter() - start, sent


def run_bare(channel: grpc.Channel, payload: bytes, count: int) -> float:
    upload = channel.stream_unary(BARE_METHOD)
    start = time.perf_counter()
    (total,) = FRAME.unpack(upload(iter([payload] * count), timeout=60))
    elapsed = time.perf_counter() - start
    assert total == count * len(payload)
    return elapsed


def run_bare_tensor(channel: grpc.Channel, tensor: torch.Tensor, count: int) -> float:
    """Bare grpcio as one would send tensors with it: the tensor's bytes copied into each message."""
    upload = channel.stream_unary(BARE_METHOD)
    start = time.perf_counter()
    (total,) = FRAME.unpack(upload((tensor.numpy().tobytes() for _ in range(count)), timeout=60))
    elapsed = time.perf_counter() - start
    assert total == count * tensor.numel() * tensor.element_size()
    return elapsed


def run_tcp(conn: socket.socket, payload: bytes, count: int) -> float:
    start = time.perf_counter()
    conn.sendall(FRAME.pack(count))
    for _ in range(count):
        conn.sendall(payload)
    assert conn.recv(1) == b"\x01"
    return time.perf_counter() - start


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"bench server on port {port} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=500, help="4 MB tensors per setup per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--serve", choices=["stage", "bare", "tcp"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Every process, ours and the peers', with the allocator settings an agent runs with: large message
    # buffers and tensors reuse freed heap memory (nodeagent.heap), so the setups differ only in their code.
    if not retain_freed_blocks():
        sys.exit("the agent's heap setting (nodeagent.heap) did not take effect here: not glibc, or malloc tuned "
                 "by MALLOC_* or GLIBC_TUNABLES; this benchmark runs every process with it")
    if args.serve:
        torch.set_num_threads(1)  # like an agent's gRPC threads
        {"stage": serve_stage, "bare": serve_bare, "tcp": serve_tcp}[args.serve](args.port)
        return

    torch.set_num_threads(1)
    ports = dict(zip(("stage", "bare", "tcp"), free_ports(3), strict=True))
    servers = [
        subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
        for kind, port in ports.items()
    ]
    try:
        for port in ports.values():
            _wait_for_port(port)
        options = grpc_channel_options(MAX_MESSAGE)
        stage_channel = grpc.insecure_channel(f"127.0.0.1:{ports['stage']}", options=options)
        bare_channel = grpc.insecure_channel(f"127.0.0.1:{ports['bare']}", options=options)
        tcp = socket.create_connection(("127.0.0.1", ports["tcp"]))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pushes = PushStream(stage_channel)
        fp32 = TransferEncoder(TransferConfig())
        int8 = TransferEncoder(TransferConfig(activations="int8", block_size=64))
        tensor = torch.randn(ROWS, COLS)
        payload = tensor.numpy().tobytes()
        setups = {
            "ours_fp32": lambda n: run_ours(pushes, fp32, n)[0],
            "ours_int8": lambda n: run_ours(pushes, int8, n)[0],
            "bare_grpc": lambda n: run_bare(bare_channel, payload, n),
            "bare_grpc_tensor": lambda n: run_bare_tensor(bare_channel, tensor, n),
            "raw_tcp": lambda n: run_tcp(tcp, payload, n),
        }
        for run in setups.values():
            run(3)  # warm up connections and allocators
        rates: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, run in setups.items():
                rates[name].append(args.tensors * TENSOR_BYTES / run(args.tensors) / 1e9)
        int8_bytes = run_ours(pushes, int8, 1)[1]
        pushes.close()
        tcp.close()
        stage_channel.close()
        bare_channel.close()
    finally:
        for server in servers:
            server.kill()
            server.wait()

    med = {name: round(statistics.median(v), 3) for name, v in rates.items()}
    figures = {
        "ours_fp32_gb_s": med["ours_fp32"],
        "ours_int8_fp32_equivalent_gb_s": med["ours_int8"],
        "bare_grpc_gb_s": med["bare_grpc"],
        "bare_grpc_tensor_gb_s": med["bare_grpc_tensor"],
        "raw_tcp_gb_s": med["raw_tcp"],
        "ours_fp32_vs_bare_grpc": round(statistics.median(
            a / b for a, b in zip(rates["ours_fp32"], rates["bare_grpc"], strict=True)), 3),
        "ours_fp32_vs_bare_grpc_tensor": round(statistics.median(
            a / b for a, b in zip(rates["ours_fp32"], rates["bare_grpc_tensor"], strict=True)), 3),
        "ours_int8_vs_ours_fp32": round(statistics.median(
            a / b for a, b in zip(rates["ours_int8"], rates["ours_fp32"], strict=True)), 3),
        "int8_wire_bytes_ratio": round(TENSOR_BYTES / int8_bytes, 3),
        "tensor_bytes": TENSOR_BYTES, "tensors_per_round": args.tensors, "rounds": args.rounds,
    }
    label = {
        "ours_fp32": "our path, fp32 (PushStream + decode_tensor)",
        "ours_int8": "our path, int8 block 64 (fp32-equivalent)",
        "bare_grpc": "bare grpcio stream of raw bytes (one pre-built bytes object, sent again and again)",
        "bare_grpc_tensor": "bare grpcio stream of the tensor's bytes (tensor.numpy().tobytes() per message)",
        "raw_tcp": "raw TCP socket",
    }
    table = "| setup | GB/s (median) | per round |\n| --- | --- | --- |\n" + "".join(
        f"| {label[name]} | {med[name]} | {', '.join(f'{v:.2f}' for v in rates[name])} |\n" for name in setups
    ) + (
        f"\nOur fp32 path / bare gRPC: **{figures['ours_fp32_vs_bare_grpc']}** against pre-built bytes, "
        f"**{figures['ours_fp32_vs_bare_grpc_tensor']}** against the tensor's bytes (medians of per-round ratios). "
        f"int8 fp32-equivalent / our fp32: **{figures['ours_int8_vs_ours_fp32']}**; "
        f"int8 sends {figures['int8_wire_bytes_ratio']}x fewer tensor bytes.\n"
    )
    write_section("tensor_transfer", (
        "## 4 MB tensor transfer on loopback (`bench/tensor_transfer.py`)\n\n"
        f"{machine_line()}. {args.rounds} alternating rounds of {args.tensors} tensors of "
        f"{TENSOR_BYTES // 2**20} MiB float32 per setup; each server is its own process, one torch thread "
        f"per process, each keeping freed blocks in its heap as an agent does (nodeagent.heap); our path keeps "
        f"{IN_FLIGHT} pushes in flight. GB/s are fp32 bytes over wall time, "
        "encoding and decoding included.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
