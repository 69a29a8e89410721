"""The GPU kit (benchmarks/gpu/) run whole on this CPU, as CI does between lent sessions:
prepare cuts the bundled model into calls, run receives them one call at a time as the
device would, then installs nothing and runs every step with few tokens."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT_DIR))

import prepare  # noqa: E402
import run  # noqa: E402


def kit(tmp_path, *args, **env):
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, ADAPTIVE_LLAMA_GPUKIT=str(tmp_path),
                                              **env))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """prepare --dry-run, then the calls one after another, as on the device."""
    where = tmp_path_factory.mktemp("gpukit")
    prepared = kit(where, KIT_DIR / "prepare.py", "--dry-run", "--models", "smollm2")
    assert prepared.returncode == 0, prepared.stderr
    calls = sorted(where.glob("call-*"))
    assert len(calls) == 3, prepared.stdout  # 94 MiB in calls of 40
    held = where / "held"
    held.mkdir()
    for call in calls:
        shutil.move(call, held / call.name)
    answers = []
    for number, call in enumerate(calls, 1):
        shutil.move(held / call.name, call)
        last = number == len(calls)
        out = where / f"out-{number}"
        args = [KIT_DIR / "run.py", "--dry-run", "--out", out] + ([] if last else
                                                                  ["--receive-only"])
        done = kit(where, *args)
        assert done.returncode == 0, done.stderr
        answers.append(json.loads((out / "gpu_kit.json").read_text()))
    return where, prepared.stdout, answers


def test_prepare_lays_out_calls_within_the_limit_and_prints_them(dry_run):
    where, printed, _ = dry_run
    plan = json.loads((where / "plan.json").read_text())
    (item,) = plan["items"]
    assert item["name"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and item["parts"] == 3
    assert printed.count("run carry=") == 3 and printed.count("--receive-only") == 2
    limit = prepare.tree_mib() + 40
    assert f"{limit - prepare.tree_mib() - prepare.MARGIN_MIB:.1f} MiB each" in printed


def test_a_model_is_joined_only_when_every_part_has_come(dry_run):
    where, _, answers = dry_run
    assert [a["received"]["SmolLM2-135M-Instruct.Q4_1.gguf"] for a in answers] == [
        False, False, True]
    assert all(a["steps"] == {} for a in answers[:2])  # receive-only calls measure nothing
    joined = where / "there" / "files" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert prepare.sha256(joined) == json.loads((where / "plan.json").read_text())[
        "items"][0]["sha256"]
    assert not list((where / "there" / "parts").iterdir())


def test_every_step_runs_on_the_cpu_and_writes_its_figures(dry_run):
    steps = dry_run[2][-1]["steps"]
    assert steps["device"]["local_gpus"] == [] and steps["device"]["llama_cpp"]
    assert all(v["returncode"] == 0 for v in steps["import_order"].values()
               if isinstance(v, dict))
    bench = next(iter(steps["bench_smollm2"]["results"].values()))
    for parallel in ("parallel_1", "parallel_2"):
        assert set(bench[parallel]["tokens_per_s"]) == {
            f"{name}/{where}" for name in run.SPECS for where in ("cpu_chain", "in_graph")}
        assert bench[parallel]["adaptive_over_greedy"]["in_graph"] > 0
    exact = steps["exact_smollm2"]
    assert exact["graph_available"]
    # On ggml's CPU backend the graph is the float64 reference's, token for token.
    assert exact["self_check"]["tokens"] >= 60
    assert exact["self_check"]["equal"] == exact["self_check"]["tokens"]
    assert exact["self_check"]["max_mass_error"] < 1e-5
    assert exact["same_seed_in_graph"]["same"] and exact["same_seed_default_path"]["same"]
    assert steps["huge_context"]["returncode"] == 1
    assert "could not create a context of 10000000 tokens" in steps["huge_context"]["last_line"]
    assert steps["bench_gemma3-270m"] == {"skipped": "the model gemma3-270m has not come"}
    # prompt lookup on the code edit: each mode against no drafts, the text the same
    spec = steps["speculative_smollm2"]["results"]
    assert set(spec) == {"code_edit adaptive:temp=0.7"}  # on the card: greedy too
    card = dict((name, args) for name, args, _ in run.plan(dry_run=False))
    assert card["speculative_smollm2"][-4:] == ["--samplers", "greedy,adaptive:temp=0.7",
                                                "--fixed", "4,16"]
    spec_args = card["speculative_smollm2"]
    assert spec_args[spec_args.index("--row-rounds") + 1] == "5"  # the dry run times one
    rows = steps["speculative_smollm2"]["decode_ms_by_rows"]  # steady and alternating shapes
    assert set(rows["steady"]) == {"1", "2", "4", "8", "16"}
    assert set(rows["after one row"]) == set(rows["one row after"]) == {"2", "4", "8", "16"}
    assert all(ms > 0 for shape in rows.values() for ms in shape.values())
    for row in spec.values():  # on the card: fixed-16 too
        assert {"none", "control", "ngram", "fixed-4"} == set(row) - {"tokens", "rule"}
        assert all(row[mode]["same_text"] for mode in ("ngram", "fixed-4"))
    # one worker holding the model, against the model alone (on this CPU, the worker's CPU)
    rpc = steps["rpc"]["models"]
    assert list(rpc) and all(m["one worker on the GPU"]["decode_vs_alone"] > 0
                             for m in rpc.values())
    row = steps["row_smollm2"]["results"]
    assert [r["vocab"] for r in row.values()] == [49152]
    profile = steps["profile_smollm2"]
    assert profile.get("skipped") == "no ncu (Nsight Compute) on this machine" or \
        "error" in profile["adaptive"] or profile["adaptive"]["kernels_per_token"] > 0


def test_parts_that_do_not_add_up_are_refused(tmp_path):
    plan = {"items": [{"kind": "model", "name": "m.gguf", "size": 3, "sha256": "0" * 64,
                       "parts": 1}]}
    call = tmp_path / "call-01"
    call.mkdir()
    (call / "manifest.json").write_text(json.dumps(plan))
    (call / "m.gguf.part000").write_bytes(b"abc")
    done = kit(tmp_path, KIT_DIR / "run.py", "--receive-only", "--dry-run", "--out",
               tmp_path / "out")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "m.gguf: the parts do not add up to its sha256"


def test_cutting_keeps_every_byte_in_order(tmp_path):
    files = []
    for name, size in (("a", 10), ("b", 25), ("c", 0), ("d", 7)):
        files.append(("model", tmp_path / name))
        files[-1][1].write_bytes(bytes(range(size)))
    calls = prepare.plan_calls(files, 12)
    assert all(sum(p["length"] for p in call) <= 12 for call in calls)
    for _, path in files:
        pieces = sorted((p for c in calls for p in c if p["name"] == path.name),
                        key=lambda p: p["part"])
        assert [p["offset"] for p in pieces] == [sum(q["length"] for q in pieces[:i])
                                                  for i in range(len(pieces))]
        assert sum(p["length"] for p in pieces) == path.stat().st_size
    assert len(calls) == 4  # 42 bytes in calls of 12


def test_ncu_csv_becomes_time_per_kernel_and_token():
    text = ('==PROF== Connected\n"ID","Process ID","Kernel Name","Metric Name","Metric Unit",'
            '"Metric Value"\n'
            '"0","1","void soft_max_f32<true, 0, 0>(const float *)","gpu__time_duration.sum","ns",'
            '"3,000"\n'
            '"1","1","k_topk(int)","gpu__time_duration.sum","ns","1000"\n'
            '"2","1","soft_max_f32<true, 0, 0>(const float *)","gpu__time_duration.sum","ns",'
            '"1000"\n')
    table = run.kernel_table(text, tokens=2)
    assert table["kernels_per_token"] == 1.5 and table["gpu_us_per_token"] == 2.5
    assert table["by_kernel"][0] == {"kernel": "soft_max_f32", "launches_per_token": 1.0,
                                     "us_per_token": 2.0}


def test_importing_the_package_loads_llama_cpps_libraries_before_numpy():
    # The import order that kept a CUDA build from crashing: libllama and what it links are
    # in the process before numpy is, and llama_cpp later maps the same file, once.
    code = ("import sys\nimport adaptive_llama\n"
            "maps = open('/proc/self/maps').read()\n"
            "assert 'numpy' not in sys.modules and 'llama_cpp' not in sys.modules\n"
            "assert 'libllama.so' in maps and 'libggml-base.so' in maps, maps\n"
            "import llama_cpp\n"
            "maps = open('/proc/self/maps').read().splitlines()\n"
            "print(len({l.split()[-1] for l in maps if 'libllama' in l}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_a_slimmed_wheel_keeps_what_loading_needs_and_a_true_record(tmp_path):
    import base64
    import hashlib
    import zipfile

    names = ["llama_cpp/__init__.py", "llama_cpp/lib/libllama.so", "llama_cpp/lib/libllama.so.0",
             "llama_cpp/lib/libggml.so", "llama_cpp/lib/libggml.so.0",
             "llama_cpp/lib/libggml-cuda.so.0", "llama_cpp/lib/libggml-cuda.so.0.25.3",
             "llama_cpp/lib/libmtmd.so.0", "lib/libllama.so", "include/llama.h",
             "llama_cpp_python-0.3.36.dist-info/METADATA",
             "llama_cpp_python-0.3.36.dist-info/RECORD"]
    wheel = tmp_path / "in" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, f"contents of {name}")
    out = tmp_path / "out"
    out.mkdir()
    slim = prepare.slim_wheel(wheel, out)
    with zipfile.ZipFile(slim) as z:
        kept = sorted(z.namelist())
        record = z.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode().splitlines()
        data = {n: z.read(n) for n in kept}
    assert kept == sorted(["llama_cpp/__init__.py", "llama_cpp/lib/libllama.so",
                           "llama_cpp/lib/libggml.so.0", "llama_cpp/lib/libggml-cuda.so.0",
                           "llama_cpp_python-0.3.36.dist-info/METADATA",
                           "llama_cpp_python-0.3.36.dist-info/RECORD"])
    for line in record[:-1]:
        name, digest, size = line.split(",")
        expected = base64.urlsafe_b64encode(hashlib.sha256(data[name]).digest()).rstrip(b"=")
        assert digest == f"sha256={expected.decode()}" and int(size) == len(data[name])
    assert record[-1] == "llama_cpp_python-0.3.36.dist-info/RECORD,," and len(record) == 6


def test_a_toolkit_without_cublas_or_libcuda_is_named_before_a_long_build(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "lib64" / "stubs").mkdir(parents=True)
    assert prepare.missing_cuda_parts(tmp_path) == ["cublas_v2.h", "libcublas.so", "libcuda.so"]
    (tmp_path / "include" / "cublas_v2.h").touch()
    (tmp_path / "lib64" / "libcublas.so").touch()
    (tmp_path / "lib64" / "stubs" / "libcuda.so").touch()
    assert prepare.missing_cuda_parts(tmp_path) == []
