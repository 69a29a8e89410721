"""Several models in one server, as ollama serves them: names, loading on demand, at most
--max-loaded at once, keep-alive, /api/ps; the GGUF header read without loading a model."""

import math
import shutil
import threading
import time

import ollama
import openai
import pytest
from test_cli import assert_one_line_error, run_cli
from test_server import API_KEY, COUNTING, raw, serving

from adaptive_llama.runtime.gguf_header import read_header
from adaptive_llama.runtime.models import ModelError
from adaptive_llama.server.errors import APIError
from adaptive_llama.server.pool import (
    MAX_KEEP_ALIVE_S,
    ModelPool,
    ServedModel,
    keep_alive_s,
    served_name,
    split_named,
)

# ---- the fast layer: names, durations, the header ----


@pytest.mark.parametrize("value,seconds", [
    ("5m", 300), ("1h30m", 5400), ("90s", 90), ("1.5h", 5400), ("250ms", 0.25), ("300", 300),
    ("0", 0), (0, 0), (10, 10), (2.5, 2.5), (-1, math.inf), ("-1", math.inf),
    ("-1s", math.inf), ("-5m", math.inf),
])
def test_keep_alive_reads_ollamas_durations(value, seconds):
    assert keep_alive_s(value) == seconds


@pytest.mark.parametrize("value", [1e308, "99999999999h", MAX_KEEP_ALIVE_S * 1.0001,
                                   f"{MAX_KEEP_ALIVE_S / 3600 + 1}h", math.inf])
def test_keep_alive_beyond_any_date_means_for_ever(value):
    # An expiry date of now + 1e308 s overflows when /api/ps shows it.
    assert keep_alive_s(value) == math.inf


def test_keep_alive_up_to_its_bound_is_kept():
    assert keep_alive_s(MAX_KEEP_ALIVE_S) == MAX_KEEP_ALIVE_S
    assert keep_alive_s(f"{MAX_KEEP_ALIVE_S / 3600:.0f}h") < math.inf


@pytest.mark.parametrize("value", ["soon", "5 m", "m", "", "1d", True, "nan"])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(ValueError, match="has to be"):
        keep_alive_s(value)


def test_a_model_argument_may_name_its_model(tmp_path):
    assert split_named("coder=~/models/q.gguf") == ("coder", "~/models/q.gguf")
    assert split_named("smollm2") == (None, "smollm2")
    odd = tmp_path / "a=b.gguf"  # a file whose name holds "=" is a path, not a name
    odd.write_bytes(b"GGUF")
    assert split_named(str(odd)) == (None, str(odd))
    with pytest.raises(ValueError, match="cannot name a model"):
        split_named("My Model=x.gguf")


def test_served_names_are_short_and_lower_case(smollm2_path, tmp_path):
    assert served_name(str(smollm2_path), smollm2_path) == "smollm2"
    assert served_name("smollm2", smollm2_path) == "smollm2"
    other = tmp_path / "Llama-3.2-1B-Instruct-Q4_K_M.gguf"
    assert served_name(str(other), other) == "llama-3.2-1b-instruct-q4_k_m"


def _served(path, name="smollm2"):
    return ServedModel(name, path, load=None, sampler=None)


def test_a_model_answers_to_its_name_file_name_and_stem(smollm2_path):
    model = _served(smollm2_path)
    for name in ("smollm2", "SmolLM2", "smollm2:latest", smollm2_path.name,
                 smollm2_path.stem):
        assert model.answers_to(name), name
    for name in ("smollm", "smollm2:7b", "gemma3-270m"):
        assert not model.answers_to(name), name


def test_the_pool_finds_models_by_name_and_names_them_when_it_cannot(smollm2_path):
    pool = ModelPool([_served(smollm2_path), _served(smollm2_path, "other")],
                     max_loaded=1, keep_alive=60, max_queue=1)
    assert pool.find(None).name == "smollm2"  # the default: the first
    assert pool.find("other:latest").name == "other"
    with pytest.raises(APIError) as caught:
        pool.find("llama3", any_name_for_one=True)  # two models: the name has to match
    assert caught.value.status == 404 and "serves smollm2, other" in caught.value.message
    alone = ModelPool([_served(smollm2_path)], max_loaded=1, keep_alive=60, max_queue=1)
    assert alone.find("gpt-4o", any_name_for_one=True).name == "smollm2"
    with pytest.raises(APIError):
        alone.find("gpt-4o")


@pytest.mark.parametrize("models,options,needle", [
    ([], {}, "at least one model"),
    (["a", "a"], {}, "two models are named 'a'"),
    (["a"], {"max_loaded": 0}, "`max_loaded` has to be at least 1"),
    (["a"], {"keep_alive": -1.0}, "`keep_alive` has to be >= 0"),
])
def test_the_pool_checks_its_arguments(smollm2_path, models, options, needle):
    with pytest.raises(ValueError, match=needle):
        ModelPool([_served(smollm2_path, n) for n in models],
                  **{"max_loaded": 1, "keep_alive": 60.0, "max_queue": 1, **options})


def test_the_header_says_what_llama_cpp_says(engine, smollm2_path):
    header = read_header(smollm2_path)
    assert header.n_params == engine.n_params == 134_515_008
    assert header.quantization == engine.quantization == "Q4_1"
    assert header.size == smollm2_path.stat().st_size
    # Every value llama.cpp reads is in the header, as the same text (long arrays aside).
    for key, text in engine.metadata.items():
        if key in header.metadata and not isinstance(header.metadata[key], (list, float)):
            value = header.metadata[key]
            assert (str(value).lower() if isinstance(value, bool) else str(value)) == text
    assert header.metadata["llama.context_length"] == 8192
    assert header.chat_template == engine.metadata["tokenizer.chat_template"]
    assert "tokenizer.ggml.tokens" not in header.metadata  # 49,152 strings, skipped
    whole = read_header(smollm2_path, whole=frozenset({"tokenizer.ggml.tokens"})).metadata
    tokens = whole["tokenizer.ggml.tokens"]  # unless asked for
    assert len(tokens) == engine.n_vocab and tokens[:3] == [
        engine.piece(t, special=True).decode() for t in range(3)]
    assert "tokenizer.ggml.merges" not in whole


def test_a_damaged_header_is_a_model_error(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[:100_000])  # ends inside the vocabulary
    with pytest.raises(ModelError, match="cut.gguf: the GGUF header is damaged"):
        read_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelError, match="not a GGUF model file"):
        read_header(other)


# ---- a real server with two models, at most one loaded ----


@pytest.fixture(scope="module")
def two(smollm2_path, tmp_path_factory):
    """`serve smollm2 -m other=COPY --max-loaded 1`: two models, one loaded at a time."""
    folder = tmp_path_factory.mktemp("two")
    copy = folder / "Other-Model.gguf"
    shutil.copy(smollm2_path, copy)
    yield from serving(smollm2_path, folder / "server.log", "-m", f"other={copy}",
                       "--max-loaded", "1", "--keep-alive", "60s", "--parallel", "2")


def ps(port):
    return raw("GET", port, "/api/ps")[2]["models"]


def loaded_names(port):
    return [m["name"] for m in ps(port)]


@pytest.fixture
def client(two):
    return ollama.Client(host=f"http://127.0.0.1:{two}",
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_every_model_is_listed_and_only_the_first_is_loaded_at_start(two, client):
    assert [m.model for m in client.list().models] == ["smollm2", "other"]
    listed = raw("GET", two, "/v1/models")[2]["data"]
    assert [m["id"] for m in listed] == ["smollm2", "other"]
    shown = client.show("other")  # read from the file: no load
    assert shown.modelinfo["llama.context_length"] == 8192
    client.generate("smollm2", prompt="")  # load it, should an earlier test have not
    assert loaded_names(two) == ["smollm2"]
    (entry,) = client.ps().models
    assert entry.size > 50_000_000 and entry.size_vram == 0 and entry.details.family == "llama"


def test_a_request_for_another_model_loads_it_in_place_of_the_idle_one(two, client):
    client.generate("smollm2", prompt="")
    reply = client.generate("other", prompt="1, 2, 3,", raw=True,
                            options={"temperature": 0, "num_predict": 6})
    assert reply.response.startswith(" 4, 5")  # the same weights: the same greedy text
    assert loaded_names(two) == ["other"]  # --max-loaded 1: smollm2 made room
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{two}/v1", api_key=API_KEY, max_retries=0)
    chat = oa.chat.completions.create(model="smollm2", max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "smollm2" and loaded_names(two) == ["smollm2"]
    with pytest.raises(openai.NotFoundError) as caught:  # two models: the name matters
        oa.chat.completions.create(model="gpt-4o", max_tokens=2,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.code == "model_not_found" and "smollm2, other" in str(caught.value)


def test_a_busy_model_is_not_unloaded_the_other_request_waits_for_it(two, client):
    client.generate("smollm2", prompt="")
    texts = {}

    def long_one():
        status, _, body = raw("POST", two, "/v1/completions",
                              {**COUNTING, "model": "smollm2", "max_tokens": 120})
        texts["long"] = (status, body["usage"]["completion_tokens"])

    worker = threading.Thread(target=long_one)
    worker.start()
    deadline = time.monotonic() + 30
    while not raw("GET", two, "/health")[2]["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    reply = client.generate("other", prompt="Hi", options={"num_predict": 2})
    worker.join(timeout=120)
    assert texts["long"] == (200, 120)  # it ran to its end: its model stayed loaded
    assert reply.done and loaded_names(two) == ["other"]


def test_keep_alive_unloads_an_idle_model_and_minus_one_keeps_it(two, client):
    client.generate("smollm2", prompt="Hi", options={"num_predict": 1}, keep_alive="1s")
    (entry,) = client.ps().models
    assert entry.model == "smollm2" and entry.expires_at is not None
    deadline = time.monotonic() + 10
    while loaded_names(two):
        assert time.monotonic() < deadline, ps(two)
        time.sleep(0.2)
    client.generate("smollm2", prompt="", keep_alive=-1)
    assert ps(two)[0]["expires_at"].startswith("2318-")  # for ever, as ollama writes it
    for beyond_any_date in (1e308, "99999999999h"):
        client.generate("smollm2", prompt="", keep_alive=beyond_any_date)
        assert ps(two)[0]["expires_at"].startswith("2318-")
    time.sleep(1.5)
    assert loaded_names(two) == ["smollm2"]


def test_keep_alive_0_without_a_prompt_unloads_at_once(two, client):
    client.generate("other", prompt="")
    assert loaded_names(two) == ["other"]
    unloaded = client.generate("other", prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload" and loaded_names(two) == []
    again = client.chat("other", messages=[], keep_alive=0)  # nothing loaded: nothing to do
    assert again.done_reason == "unload" and loaded_names(two) == []


# ---- the command line ----


def test_serve_refuses_a_bad_keep_alive_or_model_name():
    assert_one_line_error(run_cli("serve", "--keep-alive", "soon"), "--keep-alive",
                          "duration")
    assert_one_line_error(run_cli("serve", "-m", "Big Model=x.gguf"), "cannot name a model")


def test_serve_without_models_serves_those_config_toml_names(smollm2_path, tmp_path,
                                                            monkeypatch):
    config = tmp_path / "adaptive-llama" / "config.toml"
    config.parent.mkdir()
    config.write_text(f'[models.smollm2]\nsampler = "min-p:p=0.2"\n\n'
                      f'[models."{smollm2_path}"]\nsampler = "greedy"\n\n'
                      '[models.elsewhere]\nctx = 512\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    log = tmp_path / "serve.log"
    for port in serving(None, log):
        models = raw("GET", port, "/api/tags")[2]["models"]
        # The table naming the file is the same model as smollm2's: served once, under the
        # first table's name and with its settings.
        assert [m["name"] for m in models] == ["smollm2"]
        shown = raw("POST", port, "/api/show", {"model": "smollm2"})[2]
        assert shown["parameters"] == "sampler min-p:p=0.2"
    assert "not serving [models.elsewhere]" in log.read_text()


def test_a_model_file_damaged_while_serving_is_a_500_and_the_others_serve_on(
        smollm2_path, tmp_path):
    spare = tmp_path / "spare.gguf"
    shutil.copy(smollm2_path, spare)
    for port in serving(smollm2_path, tmp_path / "server.log", "-m", f"spare={spare}"):
        spare.write_bytes(smollm2_path.read_bytes()[:100_000])  # cut inside its header
        assert [m["name"] for m in raw("GET", port, "/api/tags")[2]["models"]] == ["smollm2"]
        status, _, body = raw("POST", port, "/api/show", {"model": "spare"})
        assert status == 500 and "spare.gguf: the GGUF header is damaged" in body["error"]
        status, _, body = raw("POST", port, "/api/generate",
                              {"model": "spare", "prompt": "Hi", "stream": False})
        assert status == 500 and "'spare' could not be loaded" in body["error"]
        status, _, body = raw("POST", port, "/api/generate", {
            "model": "smollm2", "prompt": "Hi", "stream": False,
            "options": {"num_predict": 2}})
        assert status == 200 and body["done"]
    assert "Traceback" not in (tmp_path / "server.log").read_text()  # one line each


@pytest.fixture(scope="module")
def three(smollm2_path, tmp_path_factory):
    """Three models, at most two loaded."""
    folder = tmp_path_factory.mktemp("three")
    copies = []
    for name in ("b", "c"):
        copies += ["-m", f"{name}={shutil.copy(smollm2_path, folder / f'{name}.gguf')}"]
    yield from serving(smollm2_path, folder / "server.log", *copies, "--max-loaded", "2",
                       "--keep-alive", "60s")


def test_room_is_made_by_unloading_the_idle_model_used_least_recently(three):
    client = ollama.Client(host=f"http://127.0.0.1:{three}",
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    # Each order: the models used, then a third one; the one left out has to be the one
    # used longest ago, not the first loaded nor the last.
    for order, third, unloaded in ((("smollm2", "b", "smollm2"), "c", "b"),
                                   (("c", "smollm2", "c"), "b", "smollm2"),
                                   (("b", "c"), "smollm2", "b")):
        for name in order:
            client.generate(name, prompt="")
            time.sleep(0.05)  # distinct times of last use
        client.generate(third, prompt="")
        assert sorted(loaded_names(three)) == sorted(set(order) - {unloaded} | {third}), order
