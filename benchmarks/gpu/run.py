"""The GPU kit's device side: install, then measure within a time budget; JSON and a log.

Run on a lent GPU machine (the device tool), in the repository root, with the folders that
benchmarks/gpu/prepare.py laid out carried one per call:

    python3 benchmarks/gpu/run.py --receive-only     # every call but the last
    python3 benchmarks/gpu/run.py [--budget 540]     # the last: install and measure

Each call moves what it carried into .gpukit/there/ (kept on the machine while it stays
warm) and joins the parts of a file once all have come, checking its sha256. The last call
installs llama-cpp-python (the wheel, or a build of the trimmed source with CUDA for the card
there), the packages the image lacks and the C kernel, then runs the steps below in order,
each in its own process with a timeout, skipping those whose estimate no longer fits the
budget: 5 minutes of device time must not be lost to one step that hangs.

- device: the card, the driver, and the devices llama.cpp sees;
- import_order: loading a model on CUDA with numpy imported first and the other ways round;
- bench_*: decode tokens/s of greedy and adaptive on the default path (chain on the host)
  and in the graph, 1 and 8 sequences (benchmarks/bench_graph.py);
- exact_*: the graph's self-check over real generations (graph.self_check), and the same
  seed giving the same reply on the default path and in the graph;
- speculative_*: prompt lookup on the code edit, against no drafts and fixed lengths
  (benchmarks/bench_speculative.py), where a batch of rows costs little more than one, and
  what a step of n rows costs steady and right after a step of another shape (CUDA graphs);
- rpc: one `adaptive-llama rpc-worker` holding every layer on the GPU, the host on the CPU,
  against the model alone on the GPU (benchmarks/bench_rpc.py --gpu);
- row_*: the host's time to choose a token from the logits row, greedy and adaptive
  (benchmarks/bench_row.py) at V 262,144, the kernel's passes on one thread and on the
  engine's (all the host's cores);
- huge_context: n_ctx = 10,000,000 has to fail fast with the one-line error;
- profile: time per CUDA kernel of decoding in the graph, adaptive against greedy (ncu; on
  one H200 it did not finish in 150 s for 16 tokens, so last, capped and bounded).

Results: $OUT/gpu_kit.json (every step's JSON or its error) and $OUT/gpu_kit.log (the
steps' output). `--dry-run` runs all of it on this CPU with the installed llama-cpp-python
and the bundled models, few tokens (CI does, so the kit keeps working between lent
sessions).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("ADAPTIVE_LLAMA_GPUKIT", ROOT / ".gpukit"))  # prepare.py's too
THERE = KIT / "there"
FILES = THERE / "files"
SITE = THERE / "site"
PROMPTS = ["The history of the river Thames begins", "Once upon a time, in a small village,",
           "The three laws of thermodynamics say that", "Here is a recipe for bread:"]
CUDA_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcuda.so.1")
# llama.cpp's own samplers beside adaptive, to share out its cost in the graph (no profiler
# needed): min-p is a softmax over V and a threshold; top-k 201 one top-k over V for as many
# candidates as adaptive's default (K = floor(1/0.005) + 1); adaptive adds its K-sized work.
SPECS = {"greedy": "greedy", "adaptive": "adaptive", "min_p": "min-p:p=0.05",
         "top_k_201": "top-k:k=201"}


# ---- receiving and installing ----

def receive() -> dict:
    """Move the carried call folders into THERE and join every file whose parts are all
    there (checked against the manifest's sha256). Returns the manifest."""
    parts = THERE / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    FILES.mkdir(parents=True, exist_ok=True)
    manifest_path = THERE / "manifest.json"
    for folder in sorted(KIT.glob("call-*")):
        for piece in folder.iterdir():
            target = manifest_path if piece.name == "manifest.json" else parts / piece.name
            shutil.move(str(piece), target)
        folder.rmdir()
    if not manifest_path.exists():
        return {"items": []}
    manifest = json.loads(manifest_path.read_text())
    for item in manifest["items"]:
        target = FILES / item["name"]
        pieces = [parts / f"{item['name']}.part{i:03d}" for i in range(item["parts"])]
        if target.exists() or not all(p.exists() for p in pieces):
            continue
        digest = hashlib.sha256()
        with open(target.with_suffix(".partial"), "wb") as out:
            for piece in pieces:
                data = piece.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != item["sha256"]:
            target.with_suffix(".partial").unlink()
            raise SystemExit(f"{item['name']}: the parts do not add up to its sha256")
        target.with_suffix(".partial").rename(target)
        for piece in pieces:
            piece.unlink()
    return manifest


def status(manifest: dict) -> dict:
    return {item["name"]: (FILES / item["name"]).exists() for item in manifest["items"]}


def cuda_library_dirs() -> tuple[list[str], list[str]]:
    """Folders holding CUDA's runtime, cuBLAS and the driver, which llama.cpp's CUDA backend
    links, and the libraries found nowhere."""
    found = {}
    roots = [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/targets/x86_64-linux/lib"),
             Path("/usr/local/nvidia/lib64"), Path("/usr/lib/x86_64-linux-gnu"),
             Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "lib",
             *sorted(Path("/usr/local").glob("cuda-*/lib64"))]
    for root in roots:
        for name in CUDA_LIBS:
            if name not in found and (root / name).exists():
                found[name] = str(root)
    return sorted(set(found.values())), [n for n in CUDA_LIBS if n not in found]


def install(manifest: dict, log) -> dict:
    """llama-cpp-python (the wheel; built from the source where no wheel came or it does not
    load here), the missing packages and the C kernel, into SITE and the tree."""
    done = THERE / "installed.json"
    if done.exists():
        return json.loads(done.read_text())
    kinds = {item["kind"]: FILES / item["name"] for item in manifest["items"]}
    wheels = [str(FILES / i["name"]) for i in manifest["items"] if i["kind"] == "wheel"]
    info = {"started": time.time()}
    info["cuda_library_dirs"], info["cuda_libraries_missing"] = cuda_library_dirs()
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--no-compile", "--upgrade", "--target", str(SITE)]
    if wheels:
        _run(pip + wheels, log)
    loads = False
    if "llama-wheel" in kinds:
        _run(pip + [str(kinds["llama-wheel"])], log)
        loads = llama_loads(info, log)
        info["wheel_loads"] = loads
    if not loads and "llama-sdist" in kinds:
        sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
        from prepare import CUDA_CMAKE_ARGS

        built = THERE / "built"
        env = dict(os.environ, CMAKE_ARGS=CUDA_CMAKE_ARGS,
                   CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 8))
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "--no-cache-dir", "-w", str(built), str(kinds["llama-sdist"])], log, env=env)
        _run(pip + [str(next(built.glob("llama_cpp_python-*.whl")))], log)
        info["built_s"] = round(time.time() - info["started"], 1)
        info["built_loads"] = llama_loads(info, log)
    _run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], log, cwd=ROOT)
    info["install_s"] = round(time.time() - info["started"], 1)
    done.write_text(json.dumps(info))
    return info


def llama_loads(info: dict, log) -> bool:
    """Whether the installed llama.cpp loads and sees a GPU of this machine (fresh process)."""
    proc = subprocess.run([sys.executable, "-c", "import sys\nfrom adaptive_llama.llama import "
                           "rpc\nsys.exit(0 if rpc.local_gpus() else 3)"],
                          env=step_env(info), capture_output=True, text=True, timeout=120)
    log.write(f"llama_cpp loads: exit status {proc.returncode}\n{proc.stderr[-3000:]}\n")
    return proc.returncode == 0


def step_env(info: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(SITE), str(ROOT)] if SITE.exists() else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    libs = info.get("cuda_library_dirs", [])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(
        os.pathsep)
    return env


def _run(cmd, log, **kwargs):
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, **kwargs)


# ---- the steps (each runs in a process of its own: python3 run.py --step NAME ...) ----

def model_path(name: str) -> Path | None:
    """The bundled model ``name`` (prepare.py's kind "model:NAME") once it has all come."""
    manifest = THERE / "manifest.json"
    items = json.loads(manifest.read_text())["items"] if manifest.exists() else []
    path = next((FILES / i["name"] for i in items if i["kind"] == f"model:{name}"), None)
    return path if path is not None and path.exists() else None


def run_device(args) -> dict:
    out = {"python": sys.version.split()[0], "machine": platform.machine()}
    smi = shutil.which("nvidia-smi")
    if smi:
        out["nvidia_smi"] = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    import llama_cpp

    from adaptive_llama.llama import rpc

    out["llama_cpp"] = llama_cpp.__version__
    out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    out["local_gpus"] = [rpc._name(d) for d in rpc.local_gpus()]
    return out


IMPORT_ORDERS = {
    "numpy_first_then_llama_cpp": "import numpy, llama_cpp\n{load_llama}",
    "llama_cpp_first": "import llama_cpp, numpy\n{load_llama}",
    "numpy_first_then_libgomp": "import numpy, ctypes\nctypes.CDLL('libgomp.so.1', "
                                "mode=ctypes.RTLD_GLOBAL)\nimport llama_cpp\n{load_llama}",
    "adaptive_llama_then_numpy": "import adaptive_llama, numpy\nfrom adaptive_llama import "
                                 "Engine\n{load_engine}",
    "numpy_first_then_adaptive_llama": "import numpy\nfrom adaptive_llama import Engine\n"
                                       "{load_engine}",
    "command_line": "import sys\nfrom adaptive_llama.cli import main\nsys.argv = ['adaptive-"
                    "llama', 'generate', {path!r}, '--n-gpu-layers', '-1', '--max-tokens', '4', "
                    "'--prompt', 'Hello']\nmain()",
}


def run_import_order(args) -> dict:
    """Each way of importing, in a fresh process: its exit status (-11 is a segfault)."""
    path = model_path("smollm2")
    load_llama = (f"m = llama_cpp.Llama({str(path)!r}, n_gpu_layers=-1, n_ctx=256, "
                  "verbose=False)\nprint(len(m.tokenize(b'hello')))")
    load_engine = (f"e = Engine({str(path)!r}, n_gpu_layers=-1, n_ctx=256)\n"
                   "print(e.generate('Hello', max_tokens=4, seed=1).completion_tokens)")
    out = {}
    for name, code in IMPORT_ORDERS.items():
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, "-c", code.format(
                load_llama=load_llama, load_engine=load_engine, path=str(path))],
                capture_output=True,
                text=True, timeout=60)
            out[name] = {"returncode": proc.returncode, "s": round(time.time() - start, 1),
                         "tail": proc.stderr.strip().splitlines()[-1:] if proc.returncode
                         else []}
        except subprocess.TimeoutExpired:
            out[name] = {"returncode": None, "timed_out": 60}
    return out


# Models without a chat template of their own, and the built-in one they take.
CHAT_TEMPLATES = {"gemma3-270m": "gemma"}


def child_json(cmd: list[str]) -> dict:
    """A benchmark's JSON, or SystemExit with the end of its own error output."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{Path(cmd[1]).name} exited with {proc.returncode}:\n"
                         + "\n".join(proc.stderr.strip().splitlines()[-12:]))
    return json.loads(proc.stdout)


def run_bench(args) -> dict:
    path = model_path(args.model)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_graph.py"), "--model", str(path),
           "--n-gpu-layers", "-1", "--rounds", str(args.rounds), "--tokens", str(args.tokens),
           "--parallel", str(args.parallel)] + (["--threads", str(args.threads)]
                                                  if args.threads else [])
    for name, spec in SPECS.items():
        cmd += ["--spec", f"{name}={spec}"]
    return child_json(cmd)


SPECULATIVE_SAMPLERS = "greedy,adaptive:temp=0.7"


def run_speculative(args) -> dict:
    """Prompt lookup on the code edit: the draft rule against no drafts and fixed lengths."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_speculative.py"),
           "--model", str(model_path(args.model)), "--n-gpu-layers", "-1",
           "--tasks", "code_edit", "--fixed", args.fixed, "--rounds", str(args.rounds),
           "--max-tokens", str(args.tokens), "--samplers", args.samplers,
           "--row-rounds", str(args.row_rounds)]
    if args.model in CHAT_TEMPLATES:
        cmd += ["--chat-template", CHAT_TEMPLATES[args.model]]
    return child_json(cmd)


def run_rpc(args) -> dict:
    """Each model alone on the GPU against one worker holding it on that GPU."""
    models = ",".join(str(model_path(m)) for m in ("smollm2", "gemma3-270m") if model_path(m))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rpc.py"), "--gpu",
           "--models", models, "--rounds", str(args.rounds), "--tokens", str(args.tokens),
           "--out", str(THERE / "bench_rpc_gpu.json")]
    return child_json(cmd)


def run_row(args) -> dict:
    """Host microseconds of choosing one token from a row of logits, greedy and adaptive
    (benchmarks/bench_row.py), with the model on the GPU."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_row.py"), "--n-gpu-layers", "-1",
           "--rounds", str(args.rounds), "--calls", str(args.tokens),
           "--model", str(model_path(args.model))]
    return child_json(cmd)


def run_exact(args) -> dict:
    """The graph's self-check over real generations, and same seed, same reply."""
    from adaptive_llama import Engine
    from adaptive_llama.llama import graph

    path = str(model_path(args.model))
    out = {}
    in_graph = Engine(path, n_gpu_layers=-1, n_ctx=1024, parallel=args.parallel,
                      backend_sampling=True, seed=1)
    out["graph_available"] = in_graph.backend_sampling
    samplers = ["adaptive", "adaptive:eps=0.0005", "adaptive:eps=0.002,temp=1.3",
                "adaptive:eps=0.001,mode=uniform"]
    with graph.self_check() as records:
        for i, (prompt, sampler) in enumerate(zip(PROMPTS * 2, samplers * 2)):
            in_graph.generate(prompt, sampler=sampler, max_tokens=args.tokens, seed=i)
        in_graph.generate_batch([PROMPTS[i % len(PROMPTS)] for i in range(args.parallel)],
                                sampler="adaptive", max_tokens=args.tokens,
                                seed=list(range(args.parallel)))
    out["self_check"] = {
        "tokens": len(records), "equal": sum(r["equal"] for r in records),
        "within_tolerance": sum(r["within_tolerance"] for r in records),
        "share_within_tolerance": round(sum(r["within_tolerance"] for r in records)
                                        / max(1, len(records)), 5),
        "max_mass_error": max((r["mass_error"] for r in records), default=None),
        "mismatches": [r for r in records if not r["within_tolerance"]][:10]}
    out["same_seed_in_graph"] = same_seed(in_graph)
    in_graph.close()
    default = Engine(path, n_gpu_layers=-1, n_ctx=1024, seed=1)
    out["same_seed_default_path"] = same_seed(default)
    default.close()
    return out


def same_seed(engine) -> dict:
    """The same prompt and seed three times, another prompt in between (the cache changes):
    whether the replies are the same, token for token."""
    prompt = PROMPTS[1]
    first = engine.generate(prompt, sampler="adaptive", max_tokens=64, seed=11).tokens
    engine.generate(PROMPTS[2], sampler="adaptive", max_tokens=16, seed=3)
    again = engine.generate(prompt, sampler="adaptive", max_tokens=64, seed=11).tokens
    third = engine.generate(prompt, sampler="adaptive", max_tokens=64, seed=11).tokens
    differs = [next((i for i, (a, b) in enumerate(zip(first, t)) if a != b), None)
               for t in (again, third)]
    return {"same": first == again == third, "tokens": len(first),
            "first_difference": differs}


def run_profile(args) -> dict:
    """Nsight Compute's time per kernel while decoding in the graph: greedy and adaptive,
    `--tokens` tokens after the prompt, the profiler started around them only."""
    found = sorted(Path("/").glob("opt/nvidia/nsight-compute/*/ncu"))
    ncu = shutil.which("ncu") or (found[-1] if found else None)
    if not ncu:
        return {"skipped": "no ncu (Nsight Compute) on this machine"}
    path = str(model_path(args.model))
    out = {}
    for name, spec in (("greedy", "greedy"), ("adaptive", "adaptive")):
        code = PROFILED.format(path=path, spec=spec, tokens=args.tokens, parallel=1)
        try:
            proc = subprocess.run(
                [str(ncu), "--profile-from-start", "off", "--clock-control", "none",
                 "--cache-control", "none", "--launch-count", str(600 * args.tokens),
                 "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base",
                 sys.executable, "-c", code], capture_output=True, text=True,
                timeout=args.timeout)
        except subprocess.TimeoutExpired:
            out[name] = {"error": f"ncu did not finish in {args.timeout:.0f} s"}
            continue
        out[name] = kernel_table(proc.stdout, args.tokens)
        if proc.returncode:
            out[name]["error"] = proc.stderr.strip().splitlines()[-3:]
    return out


PROFILED = """
import ctypes
from adaptive_llama import Engine
e = Engine({path!r}, n_gpu_layers=-1, n_ctx=512, parallel={parallel}, backend_sampling=True)
prompts = ["Once upon a time"] * {parallel}
e.generate_batch(prompts, sampler={spec!r}, max_tokens=8)
cudart = ctypes.CDLL("libcudart.so.13")
cudart.cudaProfilerStart()
e.generate_batch(prompts, sampler={spec!r}, max_tokens={tokens}, seed=list(range({parallel})))
cudart.cudaProfilerStop()
"""


def kernel_table(text: str, tokens: int) -> dict:
    """ncu's CSV -> per kernel name: launches and microseconds per generated token."""
    lines = text[text.find('"ID"'):] if '"ID"' in text else ""
    totals: dict[str, list] = {}
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].removeprefix("void ").split("(")[0].split("<")[0].strip()
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += float(row["Metric Value"].replace(",", "")) / 1000.0  # ns -> us
    table = sorted(((n, c / tokens, us / tokens) for n, (c, us) in totals.items()),
                   key=lambda r: -r[2])
    return {"tokens": tokens, "kernels_per_token": round(sum(r[1] for r in table), 1),
            "gpu_us_per_token": round(sum(r[2] for r in table), 1),
            "by_kernel": [{"kernel": n, "launches_per_token": round(c, 2),
                           "us_per_token": round(us, 2)} for n, c, us in table[:40]]}


def run_huge_context(args) -> dict:
    path = str(model_path("smollm2"))
    # llama.cpp's own log on: where it stops, if it does not fail
    code = (f"from adaptive_llama import Engine\nEngine({path!r}, n_gpu_layers=-1, "
            "n_ctx=10_000_000, verbose=True)")
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=args.timeout)
        return {"returncode": proc.returncode, "s": round(time.time() - start, 1),
                "last_line": (proc.stderr.strip().splitlines() or [""])[-1][:300]}
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-12:]
        return {"timed_out": args.timeout, "stderr_tail": tail}


STEPS = {"device": run_device, "import_order": run_import_order, "bench": run_bench,
         "exact": run_exact, "speculative": run_speculative, "rpc": run_rpc, "row": run_row,
         "profile": run_profile, "huge_context": run_huge_context}


# ---- the driver ----

def plan(dry_run: bool) -> list[tuple[str, list[str], float]]:
    """(step, its arguments, estimated seconds on the card), in the order they run."""
    tokens, rounds, parallel = ("8", "1", "2") if dry_run else ("128", "3", "8")
    few = "8" if dry_run else "64"
    # estimates: what each took on one H200 (2026-11-27), with room; the figures the issue
    # asks for first, the checks of what was shown before later
    steps = [("device", [], 10)]
    for model, bench_s in (("smollm2", 100), ("gemma3-270m", 90)):
        steps.append((f"bench_{model}", ["--model", model, "--tokens", tokens, "--rounds",
                                         rounds, "--parallel", parallel], bench_s))
    # a dry run checks that drafts keep the text with one sampler and one fixed length: the
    # kit's slowest step on a CPU, where a whole code-edit prompt is read once per sampler
    # and mode
    samplers = "adaptive:temp=0.7" if dry_run else SPECULATIVE_SAMPLERS
    for model in ("smollm2", "gemma3-270m"):
        steps.append((f"speculative_{model}", ["--model", model, "--rounds", rounds,
                                               "--row-rounds", "1" if dry_run else "5",
                                               "--tokens", "16" if dry_run else "700",
                                               "--samplers", samplers,
                                               "--fixed", "4" if dry_run else "4,16"], 60))
    steps.append(("rpc", ["--tokens", tokens, "--rounds", rounds], 40))
    row_model = "smollm2" if dry_run else "gemma3-270m"  # V 262,144 where it counts
    steps.append((f"row_{row_model}", ["--model", row_model, "--rounds", rounds,
                                       "--tokens", "20" if dry_run else "100"], 40))
    for model in ("smollm2", "gemma3-270m"):
        steps.append((f"exact_{model}", ["--model", model, "--tokens", few,
                                         "--parallel", parallel], 15))
    # On the H200 adaptive's host work at V 262,144 took twice what it takes on a 2-core
    # CPU: llama.cpp's CPU threads (one per core, spinning between graphs while the GPU does
    # the work) may be taking the cores from it. Two threads, one sequence:
    steps += [("bench_gemma3-270m_threads2", ["--model", "gemma3-270m", "--tokens", tokens,
                                              "--rounds", rounds, "--parallel", "1",
                                              "--threads", "2"], 30),
              ("import_order", [], 20),
              ("huge_context", ["--timeout", "40"], 10),
              ("profile_smollm2", ["--model", "smollm2", "--tokens", "4", "--timeout",
                                   "30" if dry_run else "100"], 200)]
    return steps


def drive(args, log) -> dict:
    """Receive; then install and run the steps, or, in a call that only receives, install
    and look at the device as soon as llama-cpp-python has come (a broken install is then
    known while the models are still on their way)."""
    start = time.time()
    manifest = receive()
    result = {"received": status(manifest), "dry_run": args.dry_run, "steps": {}}
    has_llama = any(FILES.joinpath(i["name"]).exists() for i in manifest["items"]
                    if i["kind"].startswith("llama-"))
    if args.receive_only and (args.dry_run or not has_llama
                              or (THERE / "installed.json").exists()):
        return result
    try:
        info = {} if args.dry_run else install(manifest, log)
    except (subprocess.CalledProcessError, StopIteration) as exc:
        result["install"] = {"error": str(exc)}  # the log says more
        save(args.out, result)
        return result
    result["install"] = info
    save(args.out, result)
    env = step_env(info)
    for name, step_args, estimate in plan(args.dry_run)[:1 if args.receive_only else None]:
        left = args.budget - (time.time() - start)
        result["steps"][name] = run_step(name, step_args, estimate, left, env, log, args)
        save(args.out, result)  # what was measured comes back even if the call is cut off
    result["total_s"] = round(time.time() - start, 1)
    return result


def run_step(name, step_args, estimate, left, env, log, args) -> dict:
    """One step in its own process, or why it did not run."""
    model = step_args[step_args.index("--model") + 1] if "--model" in step_args else None
    if model and model_path(model) is None:
        return {"skipped": f"the model {model} has not come"}
    if estimate > left and not args.dry_run:
        return {"skipped": f"needs about {estimate} s, {left:.0f} s left"}
    kind = name.split("_")[0] if name.startswith(
        ("bench", "exact", "profile", "speculative", "row")) else name
    cmd = [sys.executable, __file__, "--step", kind, *step_args]
    t0 = time.time()
    log.write(f"\n=== {name}: {' '.join(cmd[2:])}\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=max(30.0, min(left, 3 * estimate)))
        log.write(proc.stderr[-20000:])
        entry = json.loads(proc.stdout) if proc.returncode == 0 else {
            "error": f"exit status {proc.returncode}",
            "stderr_tail": proc.stderr.strip().splitlines()[-8:]}
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"").decode(errors="replace") if isinstance(
            exc.stderr, bytes) else exc.stderr or ""
        log.write(tail[-20000:])
        entry = {"error": "timed out", "stderr_tail": tail.strip().splitlines()[-8:]}
    log.write(f"=== {name}: {time.time() - t0:.1f} s\n")
    log.flush()
    return {"s": round(time.time() - t0, 1), **entry}


def save(out: Path, result: dict) -> None:
    (out / "gpu_kit.json").write_text(json.dumps(result, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receive-only", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for this call's steps (the device allows 600 a call)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", KIT / "out")))
    parser.add_argument("--step", choices=STEPS)
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=40.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--samplers", default=SPECULATIVE_SAMPLERS)
    parser.add_argument("--fixed", default="4,16", help="speculative: fixed draft lengths")
    parser.add_argument("--row-rounds", type=int, default=5,
                        help="speculative: timed decodes of each shape of rows")
    args = parser.parse_args(argv)
    if args.step:
        print(json.dumps(STEPS[args.step](args)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu_kit.log", "a") as log:
        result = drive(args, log)
    save(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    for name, entry in result["steps"].items():
        print(f"{name}: {entry.get('s', '-')} s "
              f"{entry.get('error') or entry.get('skipped') or 'ok'}")


if __name__ == "__main__":
    main()
