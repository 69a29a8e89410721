"""Per-model settings in config.toml: precedence, provenance, and bad files (one line, nothing
started)."""

import json
import os
import subprocess
import sys

import pytest

from adaptive_llama import config

GOOD = """\
[defaults]
threads = 2
sampler = "top-k:k=20"

[models.smollm2]
sampler = "min-p:p=0.1"
ctx = 512
system = "Answer in one word."
"""


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "adaptive-llama").mkdir()
    return tmp_path


def write(home, text):
    path = home / "adaptive-llama" / "config.toml"
    path.write_text(text)
    return path


def cli(*args, home):
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_models_table_wins_over_defaults_and_says_where_from(config_home):
    path = write(config_home, GOOD)
    s = config.settings_for("smollm2")
    assert str(s.values["sampler"]).startswith("min-p:p=0.1") and s.values["threads"] == 2
    assert s.source["sampler"] == f"{path} [models.smollm2]"
    assert s.source["threads"] == f"{path} [defaults]"
    other = config.settings_for("gemma3-270m")
    assert str(other.values["sampler"]).startswith("top-k:k=20") and "ctx" not in other.values


def test_a_table_can_name_the_file_of_a_gguf(config_home, smollm2_path):
    write(config_home, f'[models."{smollm2_path.name}"]\nctx = 1024\n')
    assert config.settings_for(str(smollm2_path)).values == {"ctx": 1024}
    assert config.settings_for("smollm2").values == {}  # another name, another table


def test_no_file_means_no_settings(config_home):
    assert config.settings_for("smollm2").values == {}


def test_generate_uses_the_file_and_the_command_line_wins(config_home):
    write(config_home, GOOD)
    out = json.loads(cli("generate", "smollm2", "--prompt", "Hi", "--max-tokens", "2",
                         "--json", home=config_home).stdout)
    assert out["sampler"].startswith("min-p:p=0.1")
    out = json.loads(cli("generate", "smollm2", "--prompt", "Hi", "--max-tokens", "2",
                         "--sampler", "greedy", "--json", home=config_home).stdout)
    assert out["sampler"] == "greedy"


def test_models_lists_each_setting_with_its_source(config_home):
    path = write(config_home, GOOD)
    rows = {r["name"]: r for r in json.loads(cli("models", "--json", home=config_home).stdout)}
    assert rows["smollm2"]["settings"]["ctx"] == {"value": "512",
                                                  "source": f"{path} [models.smollm2]"}
    text = cli("models", home=config_home).stdout
    assert f"ctx = 512  (from {path} [models.smollm2])" in text
    assert f"settings file: {path}" in text


def test_the_repl_shows_where_each_value_came_from(config_home):
    path = write(config_home, GOOD)
    out = subprocess.run(
        [sys.executable, "-m", "adaptive_llama.cli", "run", "--ctx", "768"],
        input="/show\n/set eps 0.001\n/set sampler adaptive\n/show\n",
        env={**os.environ, "XDG_CONFIG_HOME": str(config_home)}, capture_output=True,
        text=True, timeout=300).stdout
    first, second = [line for line in out.splitlines() if line.startswith("from ")]
    assert f"sampler: {path} [models.smollm2]" in first and "ctx: command line" in first
    assert f"threads: {path} [defaults]" in first and "n_gpu_layers: built-in default" in first
    assert "sampler: /set" in second
    assert "system      Answer in one word." in out


@pytest.mark.parametrize("text,needles", [
    ('[models.smollm2]\nsampler = "min-p"\nctxx = 512\n', ["line 3", "`ctxx`", "ctx,"]),
    ('[models.smollm2]\nctx = 100\n', ["line 2", "`ctx`", ">= 256", "100"]),
    ('[models.smollm2]\nsampler = "nucleus"\n', ["line 2", "`sampler`", "unknown sampler"]),
    ('[defaults]\nthreads = "many"\n', ["line 2", "`threads`", "[defaults]"]),
    ('[models.smollm2]\nsampler = min-p\n', ["line 2", "Invalid value"]),
    ('[model.smollm2]\nctx = 512\n', ["line 1", "unknown `model`"]),
    ('models = 3\n', ["line 1", "unknown `models`"]),
])
def test_a_bad_file_is_one_line_naming_file_line_and_key_and_nothing_starts(
        config_home, text, needles):
    path = write(config_home, text)
    for args in (["generate", "smollm2", "--prompt", "Hi"], ["run"], ["serve"], ["models"]):
        result = cli(*args, home=config_home)
        assert result.returncode == 2, (args, result.stderr)
        line, = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: {path}") and "Traceback" not in result.stderr
        for needle in needles:
            assert needle in line, (needle, line)
        assert "loading" not in result.stderr and not result.stdout
