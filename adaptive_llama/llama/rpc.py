"""llama.cpp's RPC backend (ggml-rpc): a model's layers on worker processes of other machines.

A worker (:func:`serve_worker`, ``adaptive-llama rpc-worker``) runs ggml's RPC server from the
installed llama.cpp library and computes the layers it is given on its own device (CPU or a
GPU). The host (:func:`connect`) registers each worker's devices with llama.cpp, which then
treats them as GPU-type devices: ``n_gpu_layers`` offloads layers to them, shared by the
``tensor_split`` weights (by the workers' free memory without them). The sampler chain runs on
the host as always.

llama.cpp aborts the process when a worker cannot be reached or stops answering
(``GGML_ABORT`` in ggml-rpc.cpp). So :func:`connect` checks each worker itself first (a TCP
connection and the protocol's HELLO, with timeouts), and :func:`on_abort` turns a later abort
into handlers that keep what the user had (a chat saved, a line naming the worker) and a
clean exit with status :data:`ABORT_STATUS`, never a core dump or a hang in gdb.

The protocol has no authentication and no encryption: a worker runs whatever graph a client
sends, so it listens on the loopback address unless told otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from typing import Callable

import llama_cpp

from . import ggml
from .ggml import RPC_CMD_DEVICE_COUNT, RPC_CMD_HELLO, RPC_CONN_CAPS, RPC_PROTOCOL

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
ABORT_STATUS = 3          # the exit status after llama.cpp aborted (a worker lost)
STEP_TIMEOUT_S = 300.0    # the longest decode step with workers before giving up on them

_HELLO_REPLY = 4 + RPC_CONN_CAPS

REBUILD = ("rebuild it with the RPC backend: `make clean && make chat` in adaptive-llama's "
           "folder, or CMAKE_ARGS=\"-DGGML_RPC=ON\" pip install --force-reinstall "
           "--no-cache-dir llama-cpp-python==" + llama_cpp.__version__)


class RpcError(ValueError):
    """A worker cannot be used, or RPC is unavailable; the message is one line (a ValueError,
    as the package's other user errors)."""


# ---- the library ----

_lock = threading.Lock()
_connected: dict[str, list[int]] = {}  # endpoint -> its devices, registered in this process


def _ggml():
    """ggml's functions (:data:`.ggml.lib`), where llama.cpp has its RPC backend; RpcError
    otherwise."""
    if not llama_cpp.llama_supports_rpc():
        raise RpcError(f"this llama-cpp-python was built without llama.cpp's RPC backend: "
                       f"{REBUILD}")
    try:
        ggml.library("ggml")
    except ggml.Unavailable as exc:
        raise RpcError(str(exc)) from None
    return ggml.lib


def _proc(name: str, signature):
    _ggml()
    try:
        return ggml.rpc_proc(name, signature)
    except ggml.Unavailable:
        raise RpcError(f"this llama-cpp-python has no {name}: {REBUILD}") from None


def _devices() -> list[int]:
    return [ggml.lib.backend_dev_get(i) for i in range(ggml.lib.backend_dev_count())]


def _name(dev: int) -> str:
    return ggml.lib.backend_dev_name(dev).decode()


def _memory(dev: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ggml.lib.backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def _is_rpc(dev: int) -> bool:
    return ggml.lib.backend_reg_name(ggml.lib.backend_dev_backend_reg(dev)) == b"RPC"


def check_available() -> None:
    """RpcError, in one line saying how to rebuild, when llama.cpp has no RPC backend."""
    _ggml()


# ---- the host side ----

def probe(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> int:
    """The number of devices the worker at ``endpoint`` serves, after the protocol's HELLO;
    RpcError naming the endpoint and what is wrong otherwise (llama.cpp itself would abort
    the process)."""
    host, port = endpoint.rsplit(":", 1)
    where = f"the RPC worker {endpoint}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.gaierror:
        raise RpcError(f"{where}: there is no host {host!r} (check the name)") from None
    except ConnectionRefusedError:
        raise RpcError(f"{where} refused the connection: start it there with "
                       f"`adaptive-llama rpc-worker --port {port}`") from None
    except TimeoutError:
        raise RpcError(f"{where} did not answer within {timeout:g} s: the machine is "
                       "unreachable, or a firewall drops the port") from None
    except OSError as exc:
        raise RpcError(f"{where} cannot be reached ({exc.strerror or exc})") from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS)
                         + bytes(RPC_CONN_CAPS))
            size, = struct.unpack("<Q", _recv(sock, 8))
            if size != _HELLO_REPLY:
                raise RpcError(f"{where} answered the handshake with {size} bytes, not "
                               f"{_HELLO_REPLY}: {_versions()}")
            major, minor, patch = _recv(sock, size)[:3]
            if major != RPC_PROTOCOL[0] or minor > RPC_PROTOCOL[1]:
                raise RpcError(f"{where} speaks RPC protocol {major}.{minor}.{patch}, this "
                               f"host {RPC_PROTOCOL[0]}.{RPC_PROTOCOL[1]}: {_versions()}")
            sock.sendall(struct.pack("<BQ", RPC_CMD_DEVICE_COUNT, 0))
            _recv(sock, 8)
            count, = struct.unpack("<I", _recv(sock, 4))
        except TimeoutError:
            raise RpcError(f"{where} accepted the connection but did not answer within "
                           f"{timeout:g} s: a worker serves one host at a time, so another "
                           "host may be using it") from None
        except ConnectionError:
            raise RpcError(f"{where} closed the connection at the handshake: it is not an "
                           f"RPC worker, or {_versions()}") from None
    if count == 0:
        raise RpcError(f"{where} serves no device")
    return count


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError
        data += chunk
    return data


def _versions() -> str:
    return (f"run the workers from the same llama-cpp-python version as this host "
            f"({llama_cpp.__version__})")


def connect(endpoints: list[str]) -> list[int]:
    """The llama.cpp devices of the workers at ``endpoints``, in order: each worker checked
    (:func:`probe`), then registered with llama.cpp once per process."""
    lib = _ggml()
    add_server = _proc("ggml_backend_rpc_add_server", ggml.RPC_ADD_SERVER)
    on_abort()  # from now on a lost worker ends the process with one line, not a core dump
    with _lock:
        for endpoint in endpoints:
            if endpoint in _connected:
                continue
            probe(endpoint)
            reg = add_server(endpoint.encode())
            if not reg:
                raise RpcError(f"the RPC worker {endpoint} serves no device")
            lib.backend_register(reg)
            _connected[endpoint] = [lib.backend_reg_dev_get(reg, i)
                                    for i in range(lib.backend_reg_dev_count(reg))]
        return [dev for endpoint in endpoints for dev in _connected[endpoint]]


def model_devices(rpc_devices: list[int]) -> ctypes.Array | None:
    """The NULL-terminated device list for ``llama_model_params.devices``: these workers'
    devices, then this machine's GPUs. None (llama.cpp's default, every GPU-type device)
    while no worker is registered in this process; otherwise a model loaded without
    workers would put its offloaded layers on those of another model."""
    if not _connected:
        return None
    chosen = rpc_devices + local_gpus()
    return (ctypes.c_void_p * (len(chosen) + 1))(*chosen, None)


def local_gpus() -> list[int]:
    """This machine's own GPU devices (CUDA, Vulkan, ...) known to llama.cpp."""
    return [dev for dev in _devices()
            if ggml.lib.backend_dev_type(dev) in (ggml.DEVICE_GPU, ggml.DEVICE_IGPU)
            and not _is_rpc(dev)]


def device_label(name: str) -> str:
    """A device as users know it: ``RPC0`` becomes ``RPC0 (10.0.0.2:50052)``."""
    for endpoint, devices in _connected.items():
        if any(_name(dev) == name for dev in devices):
            return f"{name} ({endpoint})"
    return name


def endpoints_down(endpoints: list[str], timeout: float = 1.0) -> list[str]:
    """Those of ``endpoints`` that do not answer the protocol's handshake now. (A bare TCP
    connection is not enough: the kernel still accepts them for a process being killed.)"""
    down = []
    for endpoint in endpoints:
        try:
            probe(endpoint, timeout)
        except RpcError:
            down.append(endpoint)
    return down


# ---- when llama.cpp aborts ----

_handlers: list[Callable[[str], None]] = []
_abort_callback = None
_stderr: int | None = None  # a copy of stderr's descriptor, made before llama.cpp silences it


def on_abort(handler: Callable[[str], None] | None = None) -> Callable[[], None]:
    """If llama.cpp aborts the process (a worker lost mid-reply): print one line on stderr
    saying what happened, run ``handler(line)`` (it may add what the user keeps), and exit
    with status ABORT_STATUS. Returns a function that removes the handler."""
    global _abort_callback, _stderr
    with _lock:
        if _stderr is None:
            _stderr = os.dup(2)
        if _abort_callback is None:  # kept only once llama.cpp has it
            callback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_aborting)
            _ggml().set_abort_callback(ctypes.cast(callback, ctypes.c_void_p))
            _abort_callback = callback
        if handler is not None:
            _handlers.append(handler)
    return lambda: _handlers.remove(handler) if handler in _handlers else None


def abort_line(message: str) -> str:
    """What llama.cpp's abort ``message`` means for the user, in one line."""
    text = re.sub(r"^\S+:\d+: ", "", message.strip())  # ggml's "file:line: " prefix
    workers = list(_connected)
    if "RPC" not in text or not workers:
        return f"llama.cpp stopped the process: {text}"
    down = endpoints_down(workers)
    lost = (f"the RPC worker{'s' if len(down) > 1 else ''} {', '.join(down)} stopped "
            "answering" if down else f"an RPC worker ({', '.join(workers)}) failed")
    return f"{lost} ({text}); restart {'them' if len(down) > 1 else 'it'} and start again"


def _say(text: str) -> None:
    """``text`` on stderr, also while llama.cpp has it on /dev/null (it does while a model
    loads): then on the copy of it made when the first handler was set."""
    print(text, end="", file=sys.stderr, flush=True)
    try:
        silenced = os.path.samestat(os.fstat(2), os.stat(os.devnull))
    except OSError:
        silenced = True
    if silenced and _stderr is not None:
        os.write(_stderr, text.encode("utf-8", "replace"))


def _aborting(message: bytes) -> None:
    """ggml's abort callback: runs in the thread that aborts, with llama.cpp's message; the
    process must not return to llama.cpp (it would call abort())."""
    _end(lambda: abort_line(message.decode("utf-8", "replace")))


def _end(account: Callable[[], str]) -> None:
    """Print ``account()`` as one line, run the handlers, exit with ABORT_STATUS."""
    try:
        line = account()
        _say(f"\nError: {line}\n")
        for handler in list(_handlers):
            try:
                handler(line)
            except Exception as exc:  # noqa: BLE001 - the others still run
                print(f"Error while stopping: {exc}", file=sys.stderr, flush=True)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(ABORT_STATUS)


class Watchdog:
    """Ends the process as a lost worker does (:func:`on_abort`'s line, handlers and status)
    when llama.cpp waits on the workers at ``endpoints`` for longer than ``timeout_s``:
    llama.cpp waits on a worker's connection with no timeout, so a frozen machine or a
    network that drops without a reset would stall the host for ever. Used as a context
    manager around each wait (the handshake, loading the model, making its context, each
    decode step); :meth:`progress` restarts the clock inside one (a large model's load
    reports each tensor sent). One daemon thread watches."""

    def __init__(self, endpoints: list[str], timeout_s: float):
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self._since: float | None = None
        self._stopped = threading.Event()
        on_abort()  # the handlers of the process run from one place
        threading.Thread(target=self._watch, name="rpc-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def progress(self) -> None:
        if self._since is not None:
            self._since = time.monotonic()

    def __enter__(self):
        self._since = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self._since = None

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                _end(self._line)

    def _line(self) -> str:
        return (f"no answer from the RPC worker{'s' if len(self.endpoints) > 1 else ''} "
                f"{', '.join(self.endpoints)} for {self.timeout_s:g} s (a machine frozen, or "
                "the network down); restart and start again, or give a longer --rpc-timeout "
                "for slow workers")


# ---- the worker side ----

def worker_devices(names: str | None) -> list[int]:
    """The devices a worker serves: those named (``cpu``, ``cuda0``, comma-separated, any
    case), else this machine's GPUs, else its CPU; ValueError listing the devices there are
    for an unknown name."""
    _ggml()
    local = [dev for dev in _devices() if not _is_rpc(dev)]
    if names:
        by_name = {_name(dev).lower(): dev for dev in local}
        chosen = []
        for name in (n.strip().lower() for n in names.split(",")):
            if name not in by_name:
                raise ValueError(f"--device: there is no device {name!r} here; there are "
                                 f"{', '.join(_name(dev) for dev in local)}")
            chosen.append(by_name[name])
        return chosen
    return local_gpus() or [dev for dev in local
                            if ggml.lib.backend_dev_type(dev) == ggml.DEVICE_CPU][:1]


def describe(devices: list[int]) -> str:
    _ggml()
    return ", ".join(f"{_name(dev)} ({_memory(dev)[1] / 2**30:.1f} GiB)" for dev in devices)


def check_bindable(host: str, port: int) -> None:
    """ValueError in one line unless a worker can listen on ``host:port`` (tried as ggml
    binds it, with SO_REUSEADDR), before its server starts (which would only print)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose "
                         "another --port") from None


def serve_worker(host: str, port: int, threads: int, devices: list[int],
                 cache_dir: str | None) -> threading.Thread:
    """Start ggml's RPC server on ``host:port`` (an IPv4 address) in a daemon thread, which
    ends only if the server could not start; the caller waits on it (Ctrl-C stays with the
    main thread)."""
    start = _proc("ggml_backend_rpc_start_server", ggml.RPC_START_SERVER)
    array = (ctypes.c_void_p * len(devices))(*devices)
    endpoint = f"{host}:{port}".encode()
    cache = cache_dir.encode() if cache_dir else None
    thread = threading.Thread(target=start, args=(endpoint, cache, threads, len(devices), array),
                              name="rpc-worker", daemon=True)
    thread.start()
    return thread
