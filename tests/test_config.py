"""Per-model settings in config.toml: precedence, provenance, and bad files (one line, nothing
started)."""

import json
import os
import subprocess
import sys

import pytest

from adaptive_llama.runtime import config

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


def write_file(folder, text):
    path = folder / "config.toml"
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
    path = write(config_home, GOOD + "markdown = true\n")  # into [models.smollm2]
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
    # piped, markdown is off unless asked for: the file asked
    assert f"markdown: {path} [models.smollm2]" in first and "wordwrap: built-in" in first
    assert "display     verbose off, markdown on, wordwrap off" in out


BAD_FILES = [
    ('[models.smollm2]\nsampler = "min-p"\nctxx = 512\n', ["line 3", "`ctxx`", "ctx,"]),
    ('[models.smollm2]\nctx = 100\n', ["line 2", "`ctx`", "[256, 16777216]", "100"]),
    ('[models.smollm2]\nctx = 99999999999999\n', ["line 2", "`ctx`", "99999999999999"]),
    ('[models.smollm2]\nsampler = "nucleus"\n', ["line 2", "`sampler`", "unknown sampler"]),
    ('[defaults]\nthreads = "many"\n', ["line 2", "`threads`", "[defaults]"]),
    ('[models.smollm2]\nsampler = min-p\n', ["line 2", "Invalid value"]),
    ('[model.smollm2]\nctx = 512\n', ["line 1", "unknown `model`"]),
    ('models = 3\n', ["line 1", "unknown `models`"]),
]


@pytest.mark.parametrize("text,needles", BAD_FILES)
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


@pytest.mark.parametrize("text,needles", BAD_FILES + [
    ('[models]\nsmollm2 = 3\n', ["line 2", "`models.smollm2` has to be a table"]),
    ('[defaults]\n\nctx = 0\nthreads = 0\n',
     ["line 4", "`threads` in [defaults] has to be an integer in [1, 512], but is 0"]),
    ('[defaults]\nthreads = true\n', ["line 2", "integer in [1, 512], but is True"]),
    ('[defaults]\nctx = 255\n',
     ["`ctx` in [defaults] has to be an integer in [256, 16777216] (or 0), but is 255"]),
    ('[defaults]\nn_gpu_layers = -2\n', ["line 2", "integer >= -1, but is -2"]),
    ('[defaults]\nbackend_sampling = 1\n', ["line 2", "has to be true or false, but is 1"]),
    ('[defaults]\nsystem = 1\n', ["line 2", "has to be text in quotes, but is 1"]),
    ('[defaults]\nsampler = 0.5\n', ["line 2", "has to be a sampler spec in quotes"]),
    ('[models.smollm2]\nchat_template = "chatml-4"\n',
     ["line 2", "`chat_template`", "built-in template (chatml-tools, or one of llama.cpp's"]),
    ('defaults.threads = 0\n', ["`threads` in [defaults]"]),  # dotted: no line to name
])
def test_load_names_the_file_the_line_and_what_is_wrong(tmp_path, text, needles):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}")
    for needle in needles:
        assert needle in message, (needle, message)


def test_every_key_accepts_its_bounds(tmp_path):
    path = write_file(tmp_path, "[defaults]\nctx = 0\nthreads = 512\nn_gpu_layers = -1\n"
                      "backend_sampling = false\nsystem = \"\"\nmarkdown = true\n"
                      "[models.a]\nctx = 256\n"
                      "threads = 1\nchat_template = \"chatml-tools\"\n")
    assert config.load(path) == {
        "defaults": {"ctx": 0, "threads": 512, "n_gpu_layers": -1,
                     "backend_sampling": False, "system": "", "markdown": True},
        "models.a": {"ctx": 256, "threads": 1, "chat_template": "chatml-tools"}}


def test_an_unreadable_file_is_named(tmp_path):
    path = write_file(tmp_path, "")
    path.write_bytes(b"[defaults]\nsystem = \"\xff\"\n")
    with pytest.raises(config.ConfigError, match=f"^{path}: cannot be read"):
        config.load(path)


def test_the_file_lives_under_xdg_config_home_or_dot_config(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config.config_path() == tmp_path / "adaptive-llama" / "config.toml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config.config_path() == tmp_path / "home" / ".config" / "adaptive-llama" / "config.toml"


def test_two_tables_naming_one_model_the_name_as_given_wins(tmp_path):
    # A file names the model by its stem, file name and full path: the name the user typed is
    # the most specific, then the full path, then the file name, then the stem.
    gguf = tmp_path / "tiny.gguf"
    path = write_file(tmp_path, f'[models.tiny]\nctx = 300\nthreads = 3\n'
                                f'[models."tiny.gguf"]\nctx = 400\n'
                                f'[models."{gguf}"]\nn_gpu_layers = 5\nctx = 500\n')
    settings = config.settings_for(str(gguf), path)
    assert settings.values == {"ctx": 500, "threads": 3, "n_gpu_layers": 5}
    assert settings.source["ctx"] == f'{path} [models.{gguf}]'
    assert settings.source["threads"] == f"{path} [models.tiny]"
    assert config.settings_for("tiny.gguf", path).values["ctx"] == 400
    assert config.settings_for(None, path).values == {}  # the bundled model: no table here


def test_a_table_naming_a_misspelt_bundled_model_is_warned_about(tmp_path):
    path = write_file(tmp_path, "[models.smolm2]\nctx = 512\n[models.gemma3-270m]\nctx = 512\n"
                                "[models.my-own-finetune]\nctx = 512\n")
    assert config.misspelt_tables(path) == [
        f"{path}: [models.smolm2] names no bundled model; did you mean [models.smollm2]?"]


def test_the_command_line_shows_the_warning_once_and_goes_on(config_home):
    write(config_home, "[models.smolm2]\nctx = 512\n")
    result = cli("models", home=config_home)
    assert result.returncode == 0
    assert result.stderr.count("did you mean [models.smollm2]?") == 1
