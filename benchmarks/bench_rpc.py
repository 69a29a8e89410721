"""What splitting a model over llama.cpp RPC workers costs: decode and prompt tokens/s alone,
with one worker holding every layer and with two sharing them, side by side in one run; and
what one token costs on the wire (commands, round trips and bytes per worker).

Workers are `adaptive-llama rpc-worker` processes on loopback ports, so this measures the
protocol and the pipeline, not a second machine's compute: on one machine the workers share
its cores with the host (each worker gets the cores divided by the workers of its setup).
Rounds are interleaved (alone, one worker, two workers, again) and figures are medians. The
wire is counted through a small TCP relay in front of each of one and of two more workers,
in separate runs (the relay adds its own latency). One JSON object on stdout (also written
to --out), progress on stderr. With --gpu: the model alone on this machine's GPU against
one worker holding all of it on that GPU (the host on the CPU), no wire counts.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import llama_cpp

from adaptive_llama import Engine
from adaptive_llama.llama import rpc
from adaptive_llama.runtime.threads import default_threads

# enum rpc_cmd of ggml-rpc.cpp (protocol 7), and the commands that wait for an answer
COMMANDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER",
            "BUFFER_CLEAR", "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR",
            "GRAPH_COMPUTE", "GET_DEVICE_MEMORY", "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO",
            "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR")
ANSWERED = {"ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE",
            "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GET_DEVICE_MEMORY",
            "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT"}
PROMPT = ("The history of the printing press begins in the fifteenth century, when "
          "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden screw "
          "press. ") * 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "rpc-worker",
                             "--port", str(port), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    for _ in range(150):
        try:
            rpc.probe(endpoint, timeout=2)
            return proc, endpoint
        except rpc.RpcError:
            time.sleep(0.2)
    raise SystemExit(f"the worker on {endpoint} did not start")


class CountingRelay:
    """A TCP relay in front of a worker that parses the host's commands (| cmd: 1 byte |
    size: 8 bytes | data |) and counts them, and the bytes each way."""

    def __init__(self, target: str):
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.commands: Counter = Counter()
        self.up = self.down = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        self.commands, self.up, self.down = Counter(), 0, 0

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            host, port = self.target.rsplit(":", 1)
            worker = socket.create_connection((host, int(port)))
            for sock in (client, worker):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._upstream, args=(client, worker), daemon=True).start()
            threading.Thread(target=self._downstream, args=(worker, client),
                             daemon=True).start()

    def _upstream(self, src: socket.socket, dst: socket.socket) -> None:
        buffer = b""
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                self.up += len(data)
                buffer += data
                while len(buffer) >= 9:
                    cmd, size = struct.unpack("<BQ", buffer[:9])
                    if len(buffer) < 9 + size:
                        break
                    self.commands[COMMANDS[cmd] if cmd < len(COMMANDS) else cmd] += 1
                    buffer = buffer[9 + size:]
        except OSError:
            pass
        self._close(src, dst)

    def _downstream(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                self.down += len(data)
        except OSError:
            pass
        self._close(src, dst)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        """One side gone: end the other too (a worker serves one connection at a time)."""
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def decode_rate(engine: Engine, tokens: int) -> float:
    result = engine.generate("Once upon a time", sampler="greedy", max_tokens=tokens,
                             stop=[], seed=1)
    return result.decode_tokens_per_s


def prompt_rate(engine: Engine, tokens: list[int]) -> float:
    engine.clear_cache()
    start = time.perf_counter()
    engine.prefill(tokens)
    llama_cpp.llama_synchronize(engine.ctx)  # a worker computes while llama_decode returns
    return len(tokens) / (time.perf_counter() - start)


def wire_per_token(model: str, worker_threads: int, tokens: int, workers: int) -> dict:
    """Commands, round trips and bytes per generated token through each of ``workers``."""
    started = [start_worker(worker_threads) for _ in range(workers)]
    relays = [CountingRelay(endpoint) for _, endpoint in started]
    try:
        engine = Engine(model, n_ctx=1024, rpc=[relay.endpoint for relay in relays])
        decode_rate(engine, 4)  # warm: graphs built, buffers allocated
        for relay in relays:
            relay.reset()
        made = engine.generate("Once upon a time", sampler="greedy", max_tokens=tokens,
                               seed=1).completion_tokens
        engine.close()
        # The prompt's decode is counted too, spread over the tokens made.
        return {"tokens": made, "per_worker": [{
            "commands_per_token": {name: round(n / made, 2)
                                   for name, n in sorted(relay.commands.items())},
            "round_trips_per_token": round(sum(n for name, n in relay.commands.items()
                                               if name in ANSWERED) / made, 2),
            "bytes_up_per_token": round(relay.up / made),
            "bytes_down_per_token": round(relay.down / made)} for relay in relays]}
    finally:
        for proc, _ in started:
            proc.kill()


def cpu_setups(model: str, threads: int, procs: list) -> dict[str, Engine]:
    """The model alone, on one worker and on two, each worker with its share of the cores."""
    endpoints = []
    for n in (1, 2, 2):
        proc, endpoint = start_worker(max(1, threads // n))
        procs.append(proc)
        endpoints.append(endpoint)
    return {"alone": Engine(model, n_ctx=1024, n_threads=threads),
            "one worker": Engine(model, n_ctx=1024, n_threads=threads, rpc=endpoints[:1]),
            "two workers": Engine(model, n_ctx=1024, n_threads=threads, rpc=endpoints[1:])}


def gpu_setups(model: str, procs: list) -> dict[str, Engine]:
    """The model alone on the GPU, and every layer on one worker serving that GPU (the
    host's own GPU gets none: tensor_split names the worker first, then the local GPUs)."""
    proc, endpoint = start_worker(2)
    procs.append(proc)
    gpus = len(rpc.local_gpus())
    return {"alone": Engine(model, n_ctx=1024, n_gpu_layers=-1),
            "one worker on the GPU": Engine(model, n_ctx=1024, n_gpu_layers=-1,
                                            rpc=[endpoint], tensor_split=[1.0] + [0.0] * gpus)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/bench_rpc.json")
    parser.add_argument("--gpu", action="store_true",
                        help="the model alone on this machine's GPU against one worker "
                             "holding every layer on that GPU, the host on the CPU")
    args = parser.parse_args()
    threads = default_threads()
    # The machine's cores shared among the workers of a setup: ggml's CPU threads spin while
    # they wait, so more threads than cores in all starves the worker whose turn it is.
    out = {"benchmark": "rpc", "threads": threads,
           "worker_threads": {"one worker": threads, "two workers": max(1, threads // 2)},
           "rounds": args.rounds,
           "decode_tokens": args.tokens, "models": {}}
    for model in args.models.split(","):
        procs = []
        try:
            setups = gpu_setups(model, procs) if args.gpu else cpu_setups(model, threads, procs)
            prompt = setups["alone"].tokenize(PROMPT)[:512]
            decode = {name: [] for name in setups}
            prefill = {name: [] for name in setups}
            for engine in setups.values():
                decode_rate(engine, 8)
            for r in range(args.rounds):
                print(f"{model}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for name, engine in setups.items():
                    decode[name].append(decode_rate(engine, args.tokens))
                    prefill[name].append(prompt_rate(engine, prompt))
            row = {"prompt_tokens": len(prompt),
                   "layers": {name: engine.placement() for name, engine in setups.items()}}
            for name in setups:
                row[name] = {"decode_tok_s": round(statistics.median(decode[name]), 1),
                             "prompt_tok_s": round(statistics.median(prefill[name]), 1)}
            for name in [name for name in setups if name != "alone"]:
                row[name]["decode_vs_alone"] = round(
                    row[name]["decode_tok_s"] / row["alone"]["decode_tok_s"], 3)
                row[name]["prompt_vs_alone"] = round(
                    row[name]["prompt_tok_s"] / row["alone"]["prompt_tok_s"], 3)
            for engine in setups.values():
                engine.close()
        finally:
            for proc in procs:
                proc.kill()
        if not args.gpu:
            row["wire"] = {name: wire_per_token(model, max(1, threads // n), args.tokens, n)
                           for name, n in (("one worker", 1), ("two workers", 2))}
        out["models"][model] = row
    text = json.dumps(out, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
