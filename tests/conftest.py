"""Shared fixtures: the bundled SmolLM2-135M-Instruct, loaded once per session.

ADAPTIVE_LLAMA_TEST_GPU_LAYERS=-1 offloads the test engines' layers to the GPU (a CUDA build
of llama-cpp-python).
"""

import os

import pytest

from adaptive_llama.runtime.models import BUNDLED

GPU_LAYERS = int(os.environ.get("ADAPTIVE_LLAMA_TEST_GPU_LAYERS", "0"))
ALL_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs a worker per core), each worker, and every
    command it starts, keeps to cores of its own: llama.cpp's threads spin while they wait
    for each other at every step, so two workers' threads on one core would each run a
    step per time slice. The engines then take one thread per core they have
    (:func:`adaptive_llama.runtime.threads.default_threads`)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT")
    if worker and count and ALL_CPUS is not None and int(count) <= len(ALL_CPUS):
        # a worker that replaces a crashed one is numbered on (gw2 of 2): it takes the
        # crashed one's cores, so that the crash is reported instead of an empty core list
        first = int(worker.removeprefix("gw")) % int(count)
        os.sched_setaffinity(0, sorted(ALL_CPUS)[first::int(count)])


def pytest_collection_modifyitems(config, items):
    """The numba pass of ``make test`` (ADAPTIVE_LLAMA_IMPL=numba) leaves out the cases that
    choose the backend themselves (a ``backend`` parameter, C or numba, which sets
    ``kernel.BACKEND``): they run there exactly as they ran in the first pass."""
    if os.environ.get("ADAPTIVE_LLAMA_IMPL") != "numba":
        return

    def chooses(item) -> bool:
        return "backend" in getattr(getattr(item, "callspec", None), "params", {})

    chosen = [item for item in items if chooses(item)]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if not chooses(item)]


@pytest.fixture(autouse=True)
def every_core_for_threads_tests(request):
    """A test marked ``all_cores`` (it runs llama.cpp on more threads than a worker's
    cores) gets every core while it runs: the threads it starts then may use them all."""
    if ALL_CPUS is None or not request.node.get_closest_marker("all_cores"):
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


@pytest.fixture(autouse=True)
def private_user_folders(tmp_path_factory, monkeypatch):
    """Saved chats, REPL history and config.toml of the tests (and of the commands they
    start) live in temporary folders, never in the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))


@pytest.fixture(scope="session")
def smollm2_path():
    # Installed by the `test` extra: a missing model is a broken install, not a skip.
    return BUNDLED["smollm2"].path()


@pytest.fixture(scope="session")
def engine(smollm2_path):
    from adaptive_llama import Engine

    eng = Engine(smollm2_path, seed=1, n_ctx=1024, n_gpu_layers=GPU_LAYERS)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def reasoning_model(tmp_path_factory):
    """A tiny model with DeepSeek-R1-Distill-Qwen's tokenizer and template that answers any
    chat "<think>\nLet me think</think>\n\nHello!" (tests/reasoning_model.py)."""
    import reasoning_model

    return reasoning_model.write(tmp_path_factory.mktemp("models") / "tiny-r1.gguf")


def generating_batch_rows(monkeypatch) -> list[int]:
    """The rows of every batch the decoders decode for generating sequences (a token each,
    and their drafts), prompt chunks left out: appended to the list returned, as they run."""
    from adaptive_llama.runtime.batching import Decoder

    rows: list[int] = []
    decode_tokens = Decoder._decode_tokens

    def recorded(self, generating):
        decode = self._decode
        self._decode = lambda: (rows.append(self._batch.n_tokens), decode())[1]
        try:
            decode_tokens(self, generating)
        finally:
            del self._decode

    monkeypatch.setattr(Decoder, "_decode_tokens", recorded)
    return rows
