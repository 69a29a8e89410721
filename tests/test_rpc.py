"""Models split over llama.cpp RPC workers (docs/distributed.md): real `adaptive-llama
rpc-worker` processes on loopback ports, the bundled model's layers on them, and what happens
when a worker is down, of another version, or killed in the middle of a reply."""

import ctypes
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import llama_cpp
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from conftest import generating_batch_rows
from test_server import free_port, raw

from adaptive_llama import Engine
from adaptive_llama.chat.saved import ChatStore
from adaptive_llama.cli import main
from adaptive_llama.endpoints import is_loopback, parse_endpoints
from adaptive_llama.llama import ggml, rpc
from adaptive_llama.runtime import config
from adaptive_llama.runtime.batching import CHUNK
from adaptive_llama.runtime.drafting import NgramDrafter
from adaptive_llama.runtime.loading import layer_devices

CLI = [sys.executable, "-m", "adaptive_llama.cli"]
SMOLLM2_LAYERS = 30
LONG_STORY = "Write a very long story about a dragon, in many chapters."


def start_worker(port: int, *options: str, started_with=None) -> subprocess.Popen:
    """An `adaptive-llama rpc-worker` on 127.0.0.1:port, returned once it answers."""
    proc = subprocess.Popen([*CLI, "rpc-worker", "--port", str(port), "--threads", "1",
                             *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=started_with)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            rpc.probe(f"127.0.0.1:{port}", timeout=2)
            return proc
        except rpc.RpcError:
            if proc.poll() is not None:
                pytest.fail(f"the worker did not start: {proc.communicate()}")
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the worker did not answer within 30 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def workers():
    """Two workers for the engines of this test process (a worker serves one host at a
    time, and this process keeps its connection)."""
    ports = [free_port(), free_port()]
    procs = [start_worker(port) for port in ports]
    yield [f"127.0.0.1:{port}" for port in ports]
    for proc in procs:
        stop(proc)


@pytest.fixture
def own_worker():
    """A worker for one test's own host process, stopped after it."""
    port = free_port()
    proc = start_worker(port)
    yield f"127.0.0.1:{port}", proc
    stop(proc)


@pytest.fixture(scope="module")
def split_engine(workers, smollm2_path):
    engine = Engine(smollm2_path, seed=1, n_ctx=1024, parallel=2, rpc=workers)
    yield engine
    engine.close()


# ---- endpoints and settings ----

@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:50052", ["127.0.0.1:50052"]),
    (" a:1 , b.example:65535", ["a:1", "b.example:65535"]),
    (["10.0.0.2:007"], ["10.0.0.2:7"]),
])
def test_endpoints_parse(text, expected):
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize("text, message", [
    ("127.0.0.1", "give a worker as HOST:PORT"),
    (":50052", "give a worker as HOST:PORT"),
    ("a:0", "from 1 to 65535"),
    ("a:65536", "from 1 to 65535"),
    ("a:x", "from 1 to 65535"),
    ("[::1]:50052", "IPv6"),
    ("::1:50052", "IPv6"),
    ("a:1,a:1", "given twice"),
    ("a:1,,b:2", "HOST:PORT[,HOST:PORT...]"),
    ("", "HOST:PORT"),
    ([], "at least one"),
    (",".join(f"h:{p}" for p in range(1, 18)), "at most 16"),
    ("http://10.0.0.2:50052", "without a scheme"),
    ("h" * 100_000 + ":50052", "is not a host name or address"),
    ("a b:50052", "is not a host name or address"),
])
def test_bad_endpoints_are_one_line(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")) as e:
        parse_endpoints(text)
    assert "\n" not in str(e.value)


def test_many_workers_are_refused_at_once():
    start = time.monotonic()
    with pytest.raises(ValueError, match="at most 16 workers, but 65536 are given"):
        parse_endpoints([f"h:{i % 65535 + 1}" for i in range(65536)])
    assert time.monotonic() - start < 1


def test_config_takes_workers_and_shares(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "adaptive-llama").mkdir()
    path = config.config_path()
    path.write_text('[defaults]\nrpc = ["127.0.0.1:50052", "h:2"]\ntensor_split = [3, 2]\n'
                    '[models.smollm2]\nrpc = "h:9"\n')
    assert config.settings_for("other").values["rpc"] == ["127.0.0.1:50052", "h:2"]
    assert config.settings_for("other").values["tensor_split"] == [3.0, 2.0]
    assert config.settings_for("smollm2").values["rpc"] == ["h:9"]
    for bad, why in (('rpc = ["h"]', "HOST:PORT"), ("rpc = 5", "HOST:PORT"),
                     ("tensor_split = [0, 0]", "not all 0"),
                     ('tensor_split = [1, "a"]', "shares"), ("tensor_split = [-1]", "shares")):
        path.write_text(f"[defaults]\n{bad}\n")
        with pytest.raises(config.ConfigError, match=why):
            config.load()


@pytest.mark.parametrize("option, value, message", [
    ("--rpc", "nohost", "--rpc nohost: give a worker as HOST:PORT"),
    ("--tensor-split", "3,x", "--tensor-split: '3,x' is not a list of shares"),
    ("--tensor-split", "0,0", "is not a list of shares"),
    ("--tensor-split", "1,-2", "is not a list of shares"),
])
def test_bad_options_are_one_line(option, value, message):
    result = CliRunner().invoke(main, ["generate", "--prompt", "x", option, value])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_eval_checks_its_workers():
    result = CliRunner().invoke(main, ["eval", "--rpc", "x"])
    assert result.exit_code == 2 and "--rpc x: give a worker as HOST:PORT" in result.output


def test_workers_from_config_are_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "adaptive-llama").mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    config.config_path().write_text(f'[models.smollm2]\nrpc = ["{endpoint}"]\n')
    result = subprocess.run([*CLI, "generate", "smollm2", "--prompt", "Hi", "-n", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"Error: the RPC worker {endpoint} refused the connection: start it there with "
        f"`adaptive-llama rpc-worker --port {endpoint.rsplit(':', 1)[1]}`")


@pytest.mark.parametrize("kwargs, message", [
    (dict(rpc="h:1", backend_sampling=True), "backend sampling"),
    (dict(rpc="h"), "`rpc`: h: give a worker"),
    (dict(rpc_timeout=0), "`rpc_timeout` has to be a number of seconds above 0"),
    (dict(rpc_timeout=float("inf")), "`rpc_timeout` has to be"),
    (dict(tensor_split=[0, 0]), "`tensor_split` has to be a list"),
    (dict(tensor_split=[1, float("nan")]), "`tensor_split` has to be a list"),
    (dict(tensor_split=[True]), "`tensor_split` has to be a list"),
    (dict(tensor_split=[1.0] * (llama_cpp.llama_max_devices() + 1)), "up to"),
])
def test_engine_checks_its_arguments(smollm2_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(smollm2_path, **kwargs)


def test_layer_runs():
    layers = [(2, "RPC1"), (0, "CPU"), (1, "CPU"), (3, "RPC1"), (4, "CPU")]
    assert layer_devices(layers) == [{"device": "CPU", "layers": [0, 1]},
                                     {"device": "RPC1", "layers": [2, 3]},
                                     {"device": "CPU", "layers": [4, 4]}]
    assert layer_devices([]) == []


def test_a_build_without_rpc_says_how_to_rebuild(monkeypatch, smollm2_path):
    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: False)
    with pytest.raises(rpc.RpcError, match="built without llama.cpp's RPC backend: rebuild "
                       r"it .*make clean && make chat.*-DGGML_RPC=ON"):
        Engine(smollm2_path, rpc="127.0.0.1:1")
    result = CliRunner().invoke(main, ["rpc-worker"])
    assert result.exit_code == 2 and "built without llama.cpp's RPC backend" in result.output


# ---- workers that cannot be used: checked before llama.cpp (which would abort) ----

def fake_worker(answer):
    """A TCP server on a free loopback port whose one connection gets ``answer(sock)``."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            answer(conn)
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def hello_of(major, minor, patch):
    def answer(conn):
        conn.recv(1 + 8 + 24)
        conn.sendall(struct.pack("<Q", 28) + bytes([major, minor, patch, 0]) + bytes(24))
        conn.recv(1)
    return answer


def test_worker_down_is_named(smollm2_path):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(rpc.RpcError, match=f"the RPC worker {endpoint} refused the "
                       "connection: start it there with `adaptive-llama rpc-worker --port"):
        Engine(smollm2_path, rpc=[endpoint])


def test_unknown_host_is_named():
    with pytest.raises(rpc.RpcError, match="there is no host 'nosuchhost.invalid'"):
        rpc.probe("nosuchhost.invalid:50052")


def test_worker_of_another_protocol_is_named(smollm2_path):
    endpoint = fake_worker(hello_of(6, 0, 1))
    with pytest.raises(rpc.RpcError, match=f"the RPC worker {endpoint} speaks RPC protocol "
                       "6.0.1, this host 7.0: run the workers from the same "
                       "llama-cpp-python version"):
        Engine(smollm2_path, rpc=endpoint)


def test_newer_minor_version_is_refused_and_older_taken():
    with pytest.raises(rpc.RpcError, match="speaks RPC protocol 7.1.0"):
        rpc.probe(fake_worker(hello_of(7, 1, 0)), timeout=5)
    with pytest.raises(rpc.RpcError, match="speaks RPC protocol 8.0.0"):
        rpc.probe(fake_worker(hello_of(8, 0, 0)), timeout=5)
    endpoint = fake_worker(lambda conn: _hello_and_count(conn, 2))
    assert rpc.probe(endpoint, timeout=5) == 2


def _hello_and_count(conn, count):
    conn.recv(1 + 8 + 24)
    conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
    conn.recv(1 + 8)
    conn.sendall(struct.pack("<QI", 4, count))


@pytest.mark.parametrize("answer, message", [
    (lambda conn: None, "closed the connection at the handshake"),
    (lambda conn: conn.sendall(struct.pack("<Q", 3) + b"abc"), "answered the handshake "
     "with 3 bytes"),
    (lambda conn: time.sleep(2), "did not answer within 0.5 s: a worker serves one host at "
     "a time"),
])
def test_not_a_worker_is_named(answer, message):
    endpoint = fake_worker(answer)
    with pytest.raises(rpc.RpcError, match=f"the RPC worker {endpoint} .*{message}"):
        rpc.probe(endpoint, timeout=0.5)


def test_abort_lines(monkeypatch):
    refused = f"127.0.0.1:{free_port()}"
    alive = fake_worker(lambda conn: _hello_and_count(conn, 1))
    with socket.create_server(("127.0.0.1", 0)) as silent:  # as a process being killed
        dying = f"127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setattr(rpc, "_connected", {alive: [], refused: [], dying: []})
        assert rpc.abort_line("/x/ggml-rpc.cpp:566: Remote RPC server crashed or returned "
                              "malformed response") == (
            f"the RPC workers {refused}, {dying} stopped answering (Remote RPC server crashed "
            "or returned malformed response); restart them and start again")
    alive = fake_worker(lambda conn: _hello_and_count(conn, 1))
    monkeypatch.setattr(rpc, "_connected", {alive: []})
    assert rpc.abort_line("/x/ggml-rpc.cpp:566: Remote RPC server crashed") == (
        f"an RPC worker ({alive}) failed (Remote RPC server crashed); restart it and start "
        "again")
    assert rpc.abort_line("/x/ggml.c:10: GGML_ASSERT(x) failed") == \
        "llama.cpp stopped the process: GGML_ASSERT(x) failed"


def test_abort_runs_the_handlers_then_exits(monkeypatch, capsys):
    exits, seen = [], []

    def fake_exit(status):
        exits.append(status)
        raise SystemExit(status)

    def broken(line):
        raise OSError("disk full")

    monkeypatch.setattr(rpc.os, "_exit", fake_exit)
    monkeypatch.setattr(rpc, "_connected", {})
    monkeypatch.setattr(rpc, "_handlers", [])
    rpc.on_abort(broken)
    remove = rpc.on_abort(seen.append)
    with pytest.raises(SystemExit):
        rpc._aborting(b"/x/ggml.c:1: boom")
    assert exits == [rpc.ABORT_STATUS] and seen == ["llama.cpp stopped the process: boom"]
    err = capsys.readouterr().err
    assert "Error: llama.cpp stopped the process: boom" in err
    assert "Error while stopping: disk full" in err
    remove()
    assert rpc._handlers == [broken]
    remove()  # twice: nothing to remove
    assert rpc._handlers == [broken]


def test_the_abort_callback_is_llamas(monkeypatch):
    """Installed in the ggml that libllama uses (not in a copy of the library)."""
    monkeypatch.setattr(rpc, "_handlers", [])
    rpc.on_abort()
    ours = ctypes.cast(rpc._abort_callback, ctypes.c_void_p).value
    assert ggml.lib.set_abort_callback(ctypes.cast(rpc._abort_callback, ctypes.c_void_p)) == ours
    libllama = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libllama.so"))
    assert ctypes.cast(libllama.ggml_abort, ctypes.c_void_p).value == \
        ctypes.cast(ggml.library("ggml-base").ggml_abort, ctypes.c_void_p).value


def test_a_real_abort_is_one_line_and_status_3():
    """llama.cpp aborts on a worker it cannot connect to (what connect() prevents by
    checking first): the handler runs and the process exits with status 3, no core dump."""
    port = free_port()
    code = ("from adaptive_llama.llama import rpc\n"
            "rpc.on_abort(lambda line: print('kept:', line, flush=True))\n"
            "add = rpc._proc('ggml_backend_rpc_add_server', rpc.ggml.RPC_ADD_SERVER)\n"
            f"add(b'127.0.0.1:{port}')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == rpc.ABORT_STATUS
    line = f"llama.cpp stopped the process: Failed to connect to 127.0.0.1:{port}"
    assert result.stdout.strip() == f"kept: {line}"
    assert result.stderr.strip() == f"Error: {line}"


def test_one_worker_down_is_singular(monkeypatch):
    down = f"127.0.0.1:{free_port()}"
    monkeypatch.setattr(rpc, "_connected", {down: []})
    assert rpc.abort_line("x.cpp:1: Remote RPC server crashed") == (
        f"the RPC worker {down} stopped answering (Remote RPC server crashed); restart it "
        "and start again")


def test_model_devices_end_with_null(monkeypatch):
    monkeypatch.setattr(rpc, "_connected", {})
    assert rpc.model_devices([]) is None  # llama.cpp's own choice while no worker is known
    monkeypatch.setattr(rpc, "_connected", {"h:1": [1234]})
    devices = rpc.model_devices([1234])
    assert list(devices) == [1234, *rpc.local_gpus(), None]


def test_sixteen_workers_are_the_most():
    assert len(parse_endpoints([f"h:{p}" for p in range(1, 17)])) == 16


def test_loopback_names():
    assert is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("10.0.0.1") and not is_loopback("nosuchhost.invalid")


@pytest.mark.parametrize("error, message", [
    (TimeoutError(), "did not answer within 0.5 s: the machine is unreachable, or a firewall "
     "drops the port"),
    (OSError(101, "Network is unreachable"), "cannot be reached (Network is unreachable)"),
])
def test_unreachable_workers(monkeypatch, error, message):
    def connect(address, timeout):
        raise error

    monkeypatch.setattr(rpc.socket, "create_connection", connect)
    with pytest.raises(rpc.RpcError) as e:
        rpc.probe("10.1.2.3:50052", timeout=0.5)
    assert str(e.value) == f"the RPC worker 10.1.2.3:50052 {message}"


def test_an_answer_in_pieces_is_read_whole():
    def answer(conn):
        conn.recv(1 + 8 + 24)
        for byte in struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24):
            conn.sendall(bytes([byte]))
            time.sleep(0.001)
        conn.recv(1 + 8)
        conn.sendall(struct.pack("<QI", 4, 3))

    assert rpc.probe(fake_worker(answer), timeout=5) == 3


# ---- the worker command ----

def test_worker_refuses_a_public_address_without_allow_remote():
    result = CliRunner().invoke(main, ["rpc-worker", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "no authentication" in result.output and "--allow-remote" in result.output


def test_worker_on_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = subprocess.run([*CLI, "rpc-worker", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"Error: cannot listen on 127.0.0.1:{port} (Address "
                                     "already in use): choose another --port")


def test_worker_device_names():
    result = CliRunner().invoke(main, ["rpc-worker", "--device", "cuda7"])
    assert result.exit_code == 2
    assert "--device: there is no device 'cuda7' here; there are CPU" in result.output
    cpu = rpc.worker_devices("CPU")
    assert len(cpu) == 1 and rpc._name(cpu[0]) == "CPU" and rpc.worker_devices("cpu") == cpu
    assert rpc.worker_devices(" cpu ,CPU") == cpu * 2
    assert rpc.worker_devices(None) == (rpc.local_gpus() or cpu)  # GPUs first, else the CPU
    assert "CPU (" in rpc.describe(cpu) and "GiB)" in rpc.describe(cpu)


def signal_masks(pid: int) -> str:
    """The blocked, ignored and caught signals of a process, as the kernel reports them."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job of a script


def block_sigint():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("started_with", [None, ignore_sigint, block_sigint])
def test_worker_stops_cleanly_on_ctrl_c(started_with):
    port = free_port()
    proc = start_worker(port, started_with=started_with)
    endpoint = f"127.0.0.1:{port}"
    masks = signal_masks(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)  # seconds on a quiet machine; CI may be busy
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the worker did not stop on SIGINT ({masks})")
    assert proc.returncode == 0
    assert f"RPC worker on {endpoint} serving CPU" in err and "RPC worker stopped." in err


# ---- a model split over workers ----

def test_layers_are_on_the_workers(split_engine, workers):
    first, second = workers
    runs = split_engine.layers
    assert [run["device"].split(" ", 1)[1] for run in runs] == [f"({first})", f"({second})"]
    assert all(run["device"].startswith("RPC") for run in runs)
    assert runs[0]["layers"][0] == 0 and runs[-1]["layers"][1] == SMOLLM2_LAYERS
    assert runs[0]["layers"][1] + 1 == runs[1]["layers"][0]
    assert split_engine.placement().endswith(f"-{SMOLLM2_LAYERS - 1} and output")
    assert split_engine.batch_invariant


@pytest.mark.parametrize("sampler", [
    "greedy", "adaptive", "adaptive:eps=0.001,temp=1.5", "top-p:p=0.9", "min-p:p=0.1,temp=1.2",
    "adaptive+penalties:repeat=1.3+dry", "typical:p=0.9", "eta", "mirostat",
])
def test_same_seed_same_text_as_alone(engine, split_engine, sampler):
    alone = engine.generate("Tell me about the sea.", chat=True, sampler=sampler,
                            max_tokens=48, seed=11)
    split = split_engine.generate("Tell me about the sea.", chat=True, sampler=sampler,
                                  max_tokens=48, seed=11)
    assert split.text == alone.text and split.completion_tokens == alone.completion_tokens


@pytest.mark.all_cores
def test_past_512_cells_a_worker_computes_a_row_as_the_host_alone(engine, smollm2_path):
    """A reply's tokens one by one with 512 cells or more in view, where llama.cpp's own
    kernel would split a row over a worker's (two) threads: the worker takes the reference
    kernel (adaptive-llama rpc-worker), so the logits are those of the host alone, bit for
    bit."""
    port = free_port()
    worker = start_worker(port, "--threads", "2")
    split = Engine(smollm2_path, n_ctx=1024, rpc=[f"127.0.0.1:{port}"])
    try:
        tokens = engine.tokenize("The history of the river Danube is long and full of "
                                 "events. " * 60)[:576 + 4]  # 9 whole chunks, 4 rows alone
        rows = []
        for each in (engine, split):
            each.prefill(tokens, generated=4)
            rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(each.ctx, -1),
                                              shape=(each.n_vocab,)).copy())
        engine.clear_cache()
    finally:
        split.close()
        stop(worker)
    assert np.array_equal(rows[0], rows[1])


def test_batched_replies_match_alone(engine, split_engine):
    prompts = ["The capital of France is", "Water boils at", "A haiku about rain:"]
    alone = engine.generate_batch(prompts, sampler="adaptive", max_tokens=24, seed=5)
    split = split_engine.generate_batch(prompts, sampler="adaptive", max_tokens=24, seed=5)
    assert [r.text for r in split] == [r.text for r in alone]


class _FullDrafts(NgramDrafter):
    """Prompt lookup's drafts, made as long as asked with their last token."""

    def draft(self, wants):
        drafts = super().draft(wants)
        return [d + [(d or state.tokens)[-1]] * (n - len(d))
                for d, (_, state, n) in zip(drafts, wants)]


def test_with_workers_drafts_keep_the_text_and_batches_stay_under_a_chunk(
        engine, workers, smollm2_path, monkeypatch):
    """The workers compute a whole prompt chunk (CHUNK rows) with the tiled kernel, any other
    batch with the reference one, as the host does; so the host keeps every other batch under
    CHUNK rows (here four sequences drafting all they may, up to 31 tokens each), and a reply
    with drafts and workers is the same text as alone without either."""
    prompts = [f"Repeat exactly, twice: {s} {s}" for s in (
        "The quick brown fox jumps over the lazy dog.", "One, two, three, four, five, six.",
        "Red sky at night, sailor's delight.", "All that glitters is not gold.")]
    alone = engine.generate_batch(prompts, sampler="greedy", max_tokens=40, seed=2)
    drafted = Engine(smollm2_path, seed=1, n_ctx=1024, parallel=4, rpc=workers,
                     draft="ngram", draft_max=31)
    drafted.decoder.speculation.drafter = _FullDrafts()
    drafted.decoder.speculation.fixed = 31
    rows = generating_batch_rows(monkeypatch)
    try:
        split = drafted.generate_batch(prompts, sampler="greedy", max_tokens=40, seed=2)
    finally:
        drafted.close()
    assert [r.text for r in split] == [r.text for r in alone]
    assert sum(r.draft_accepted for r in split) > 0
    assert max(rows) == CHUNK - 1  # the drafts fill a step up to the bound, never past it


def test_shares_and_local_layers(workers, smollm2_path):
    first, second = workers
    engine = Engine(smollm2_path, n_ctx=256, rpc=workers, tensor_split=[1, 0])
    try:
        assert len(engine.layers) == 1 and engine.layers[0]["device"].endswith(f"({first})")
        assert engine.layers[0]["layers"] == [0, SMOLLM2_LAYERS]
    finally:
        engine.close()
    engine = Engine(smollm2_path, n_ctx=256, rpc=workers, n_gpu_layers=10)
    try:
        assert engine.layers[0] == {"device": "CPU", "layers": [0, SMOLLM2_LAYERS - 10]}
        assert {run["device"].split(" ")[-1] for run in engine.layers[1:]} == \
            {f"({first})", f"({second})"}
    finally:
        engine.close()
    with pytest.raises(ValueError, match="`tensor_split` has 3 shares, but there are 2 "
                       "worker and 0 local GPU devices"):
        Engine(smollm2_path, rpc=workers, tensor_split=[1, 1, 1])


def test_placement_text(engine, workers, smollm2_path):
    assert engine.placement() == f"CPU 0-{SMOLLM2_LAYERS - 1} and output"
    split = Engine(smollm2_path, n_ctx=256, rpc=workers[:1], n_gpu_layers=1)
    try:  # only the output layer offloaded
        assert split.placement() == (f"CPU 0-{SMOLLM2_LAYERS - 1}; {split.layers[1]['device']} "
                                     "output")
    finally:
        split.close()


def test_the_watchdog_watches_steps_only(monkeypatch):
    ended = []
    monkeypatch.setattr(rpc, "_end", lambda account: ended.append(account()))
    watchdog = rpc.Watchdog(["h:1", "h:2"], 0.2)
    time.sleep(0.5)
    assert ended == []  # idle between steps: nothing to watch
    with watchdog:
        time.sleep(0.1)
    assert ended == []
    with watchdog:
        time.sleep(0.6)
    watchdog.stop()
    assert ended[:1] == ["no answer from the RPC workers h:1, h:2 for 0.2 s (a machine "
                         "frozen, or the network down); restart and start again, or give a "
                         "longer --rpc-timeout for slow workers"]


def test_an_engine_without_workers_stays_on_the_cpu(split_engine, smollm2_path):
    engine = Engine(smollm2_path, n_ctx=256, n_gpu_layers=-1)
    try:
        assert engine.layers == [{"device": "CPU", "layers": [0, SMOLLM2_LAYERS]}]
    finally:
        engine.close()


# ---- the commands, each with its own worker ----

def test_generate_json_names_the_layers(own_worker):
    endpoint, _ = own_worker
    result = subprocess.run([*CLI, "generate", "--rpc", endpoint, "--prompt", "Hello",
                             "-n", "8", "--sampler", "greedy", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["layers"] == [{"device": f"RPC0 ({endpoint})", "layers": [0, SMOLLM2_LAYERS]}]
    assert out["completion_tokens"] == 8


def wait_for_text(stream, min_chars: int, timeout: float = 60) -> str:
    """Read ``stream`` until ``min_chars`` characters have come (a reply under way), for at
    most ``timeout`` seconds: a reply that ends sooner (the REPL then waits for input) must
    fail the test, not hang it."""
    import select

    got = ""
    deadline = time.monotonic() + timeout
    while len(got) < min_chars and (left := deadline - time.monotonic()) > 0:
        if not select.select([stream], [], [], left)[0]:
            break
        piece = stream.read(1)
        if not piece:
            break
        got += piece
    return got


def test_worker_killed_mid_reply_ends_generate_with_one_line(own_worker):
    endpoint, worker = own_worker
    proc = subprocess.Popen([*CLI, "generate", "--rpc", endpoint, "--prompt", "Once upon a "
                             "time", "-n", "5000", "--sampler", "adaptive:temp=1.5",
                             "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shown = wait_for_text(proc.stdout, 40)
    worker.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == rpc.ABORT_STATUS
    assert len(shown) >= 40
    assert err.strip() == (f"Error: the RPC worker {endpoint} stopped answering (Remote RPC "
                           "server crashed or returned malformed response); restart it and "
                           "start again")


def test_frozen_worker_ends_generate_after_the_timeout(own_worker):
    endpoint, worker = own_worker
    proc = subprocess.Popen([*CLI, "generate", "--rpc", endpoint, "--rpc-timeout", "3",
                             "--prompt", "Once upon a time", "-n", "5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_text(proc.stdout, 40)
    worker.send_signal(signal.SIGSTOP)  # alive to the kernel, silent to the host
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        worker.kill()
    assert proc.returncode == rpc.ABORT_STATUS
    assert err.strip() == (f"Error: no answer from the RPC worker {endpoint} for 3 s (a "
                           "machine frozen, or the network down); restart and start again, "
                           "or give a longer --rpc-timeout for slow workers")


def test_worker_killed_mid_reply_keeps_the_chat(own_worker, tmp_path):
    endpoint, worker = own_worker
    # A seed whose reply runs past 200 characters (without one a short reply could come)
    proc = subprocess.Popen([*CLI, "run", "--rpc", endpoint, "-n", "5000", "--seed", "1",
                             "--sampler", "adaptive:temp=1.5"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write(LONG_STORY + "\n")
    proc.stdin.flush()
    shown = wait_for_text(proc.stdout, 200)
    worker.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == rpc.ABORT_STATUS
    assert f"Error: the RPC worker {endpoint} stopped answering" in err
    store = ChatStore()
    name = store.latest()
    assert f"the chat is saved as {name}: `adaptive-llama run --resume {name}`" in out
    saved = store.load(name)
    assert saved["messages"][0] == {"role": "user", "content": LONG_STORY}
    reply = saved["messages"][1]["content"]
    shown_reply = (shown + out).split("the chat is saved")[0]
    assert len(reply) >= 150 and reply[:100] in shown_reply


def test_server_answers_its_clients_when_a_worker_dies(own_worker, tmp_path):
    endpoint, worker = own_worker
    port = free_port()
    log = tmp_path / "serve.log"
    server = subprocess.Popen([*CLI, "serve", "--rpc", endpoint, "--port", str(port),
                               "--parallel", "2", "--ctx", "2048"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, _, body = raw("GET", port, "/health", key=None)
            break
        except OSError:
            time.sleep(0.2)
    else:
        server.kill()
        pytest.fail(log.read_text())
    assert body["loaded"][0]["layers"][0]["device"].endswith(f"({endpoint})")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0, timeout=60)
    results = {}

    def waiting():  # a request answered in one piece, decoding beside the stream
        try:
            results["waiting"] = raw("POST", port, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": LONG_STORY}],
                "max_tokens": 1500, "temperature": 1.5}, key=None)
        except OSError as exc:
            results["waiting"] = exc

    thread = threading.Thread(target=waiting)
    thread.start()
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": LONG_STORY}], stream=True,
        max_tokens=1500, temperature=1.5)
    received, error = "", None
    try:
        for chunk in stream:
            received += chunk.choices[0].delta.content or "" if chunk.choices else ""
            if len(received) > 100 and worker.poll() is None:
                worker.kill()
    except openai.APIError as exc:
        error = exc
    thread.join(timeout=60)
    assert server.wait(timeout=60) == rpc.ABORT_STATUS
    status, _, body = results["waiting"]
    assert status == 500
    assert f"the RPC worker {endpoint} stopped answering" in body["error"]["message"]
    assert error is not None and f"the RPC worker {endpoint} stopped answering" in str(error)
    assert f"Error: the RPC worker {endpoint} stopped answering" in log.read_text()


# ---- a worker that outlives ggml's server; every wait on a worker bounded ----

def _hello(sock: socket.socket) -> None:
    sock.sendall(struct.pack("<BQ", 14, 24) + bytes(24))  # RPC_CMD_HELLO
    assert len(sock.recv(64)) == 8 + 28


@pytest.mark.parametrize("message,crashes", [
    (struct.pack("<BQ", 6, 2**63), True),  # RPC_CMD_SET_TENSOR of 2^63 bytes: ggml aborts
    (struct.pack("<BQ", 10, 2**62), False),  # RPC_CMD_GRAPH_COMPUTE of 2^62: ggml refuses it
])
def test_a_message_that_crashes_ggmls_server_is_one_line_and_the_next_host_is_served(
        message, crashes):
    port = free_port()
    proc = start_worker(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            _hello(sock)
            peer = "%s:%d" % sock.getsockname()
            sock.sendall(message)
            assert sock.recv(64) == b""  # the server ended with the connection
        assert rpc.probe(f"127.0.0.1:{port}", timeout=30) == 1  # the next host is served
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if "stopped on a message" in line]
    assert len(lines) == crashes, err
    if crashes:
        assert f"from {peer} (" in lines[0] and "started again for the next host" in lines[0]
    assert "Backtrace" not in err and "gdb" not in err and len(err.splitlines()) == 2 + crashes


def test_a_killed_worker_leaves_no_server_behind():
    port = free_port()
    proc = start_worker(port)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert children  # ggml's server, in a process of its own
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)


def proxy(port: int, *, cut_after: int, close: bool) -> str:
    """A loopback relay to the worker on ``port``: its first connection (the host's check)
    whole; later ones pass ``cut_after`` bytes from the host, then the relay closes both
    sides (``close``) or stops relaying and holds them open (a frozen machine)."""
    server = socket.create_server(("127.0.0.1", 0))
    connections = []

    def relay(client: socket.socket) -> None:
        connections.append(client)
        upstream = socket.create_connection(("127.0.0.1", port))
        passed = 0
        while True:
            for sock in select.select([client, upstream], [], [])[0]:
                data = sock.recv(65536)
                if sock is client:
                    passed += len(data)
                if not data or (len(connections) > 1 and passed > cut_after):
                    if close or not data:
                        client.close()
                        upstream.close()
                        return
                    time.sleep(3600)
                (upstream if sock is client else client).sendall(data)

    def serve() -> None:
        while True:
            threading.Thread(target=relay, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("cut_after,close,line", [
    (0, False, "no answer from the RPC worker {} for 3 s"),  # the handshake withheld
    (1_000_000, False, "no answer from the RPC worker {} for 3 s"),  # frozen mid-load
    (1_000_000, True, "Error: an RPC worker ({}) failed"),  # lost mid-load
])
def test_a_worker_frozen_or_lost_while_the_model_loads_is_one_line_and_status_3(
        smollm2_path, own_worker, cut_after, close, line):
    endpoint, _ = own_worker
    relayed = proxy(int(endpoint.rsplit(":", 1)[1]), cut_after=cut_after, close=close)
    start = time.monotonic()
    result = subprocess.run([*CLI, "generate", str(smollm2_path), "--rpc", relayed,
                             "--rpc-timeout", "3", "-n", "1", "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == rpc.ABORT_STATUS, result.stderr
    assert time.monotonic() - start < 60
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and line.format(relayed) in lines[0], result.stderr


def test_the_watchdog_clock_stops_between_waits():
    """Idle past the timeout between two steps is no frozen worker."""
    code = ("import time\nfrom adaptive_llama.llama import rpc\n"
            "dog = rpc.Watchdog(['127.0.0.1:1'], 0.4)\n"
            "with dog: time.sleep(0.1)\n"
            "time.sleep(1.5)\n"
            "with dog:\n    dog.progress(); time.sleep(0.3); dog.progress(); time.sleep(0.3)\n"
            "print('alive', flush=True)\n"
            "with dog: time.sleep(3)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "alive"  # idle, then progress inside: still running
    assert result.returncode == rpc.ABORT_STATUS  # a wait past the timeout: ended
    assert "no answer from the RPC worker 127.0.0.1:1 for 0.4 s" in result.stderr


def test_a_worker_without_the_memory_for_its_layers_is_named(smollm2_path, own_worker):
    """Its allocation fails (the address space of ggml's server bounded a little past what
    it has): the line names the worker and the size, not a corrupt file."""
    endpoint, proc = own_worker
    server = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0]
    status = Path(f"/proc/{server}/status").read_text()
    size_kb = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmSize")))
    subprocess.run(["prlimit", f"--as={(size_kb + 20 * 1024) * 1024}", "--pid", server],
                   check=True)
    result = subprocess.run([*CLI, "generate", str(smollm2_path), "--rpc", endpoint, "-n",
                             "1", "--prompt", "hi"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {smollm2_path}: RPC0 ({endpoint}) could not allocate 92 MiB for its share of "
        "the model: give it fewer layers (--tensor-split, --n-gpu-layers) or use a device "
        "with more free memory"]


# ---- ggml's ABI in one module (adaptive_llama.llama.ggml) ----

def test_the_mirrored_layouts_hold_and_a_moved_one_is_named(monkeypatch):
    ggml.check_layouts()
    for name, moved, says in (("BACKEND_GRAPH_COMPUTE", 12, "graph_compute entry moved"),
                              ("BACKEND_DEVICE", 18, "get_name and device entries moved"),
                              ("DEVICE_GET_TYPE", 0, "get_name and get_type entries moved"),
                              ("TENSOR_NE", 24, "sizes (ne) elsewhere"),
                              ("TENSOR_OP", 84, "operation (op) elsewhere")):
        monkeypatch.setattr(ggml, name, moved)
        ggml.check_layouts.cache_clear()
        try:
            with pytest.raises(ggml.Unavailable, match=re.escape(says)) as caught:
                ggml.check_layouts()
            assert "\n" not in str(caught.value)
        finally:
            monkeypatch.undo()
            ggml.check_layouts.cache_clear()
    ggml.check_layouts()


def test_library_names_by_platform():
    assert ggml.file_names("ggml-base", "linux") == ["libggml-base.so.0", "libggml-base.so"]
    assert ggml.file_names("ggml", "darwin") == ["libggml.0.dylib", "libggml.dylib"]
    assert ggml.file_names("ggml-cpu", "win32")[0] == "ggml-cpu.dll"


def _engine_in_a_process(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_libraries_under_other_names_fall_back_with_one_warning():
    """As on a platform whose libraries are named otherwise: flash attention off, one
    warning that names what is missing, the engine working."""
    result = _engine_in_a_process(
        "from adaptive_llama.llama import ggml\n"
        "ggml.file_names = lambda stem, platform=None: [f'lib{stem}.elsewhere']\n"
        "from adaptive_llama import Engine\n"
        "engine = Engine('smollm2', n_ctx=256)\n"
        "print(engine.attention, engine.generate('Hi', max_tokens=3, seed=1).completion_tokens)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["off", "3"]
    warnings = [line for line in result.stderr.splitlines() if "flash attention is off" in line]
    assert len(warnings) == 1 and "libggml-base.elsewhere" in warnings[0]


def test_llama_cpp_lib_path_names_the_libraries(tmp_path):
    for library in (Path(llama_cpp.__file__).parent / "lib").iterdir():
        (tmp_path / library.name).symlink_to(library)
    result = _engine_in_a_process(
        "from adaptive_llama.llama import ggml\n"
        "from adaptive_llama import Engine\n"
        "engine = Engine('smollm2', n_ctx=256)\n"
        "print(engine.attention, ggml.library('ggml-base')._name)\n",
        env={"LLAMA_CPP_LIB_PATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["reference", str(tmp_path / "libggml-base.so.0")]


def test_settings_are_checked_without_loading_llama_cpp(tmp_path):
    result = _engine_in_a_process(
        "import sys\nfrom adaptive_llama.runtime import config\n"
        "print(config.KEYS['rpc'](['10.0.0.2:50052']), config.KEYS['tensor_split']([3, 2]))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'numpy'))))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['10.0.0.2:50052'] [3.0, 2.0]", "[]"]
