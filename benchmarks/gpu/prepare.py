"""Lay out what a lent GPU machine needs for benchmarks/gpu/run.py, in calls that fit.

A lent machine (the device tool) has no network and takes at most 64 MiB per call: the
working tree plus the paths a call carries. This script puts everything the run needs in
.gpukit/ (ignored by git), cut into one folder per call:

- llama-cpp-python: a wheel built with CUDA for the lent card (--wheel; `--build-wheel`
  builds it here when a CUDA compiler and cuBLAS are found, about 40 minutes on 2 cores and
  none of the lease), and/or its source trimmed to what CMake needs (--sdist, 4 MB), which
  run.py builds there when no wheel came or the wheel does not load there (about 5 minutes
  of the lease on 16 cores);
- the wheels of the Python packages the device's image lacks (diskcache);
- the models, each cut into parts that run.py joins and checks against their sha256.

It prints the device calls to make, in order: each carries one folder; the machine keeps what
earlier calls brought while it stays warm (30 s), so make them one after another. The last
call runs the measurements. `--dry-run` prepares for this CPU instead (no downloads, no CUDA;
what CI runs to keep the kit working between lent sessions).

    python benchmarks/gpu/prepare.py --wheel PATH [--models smollm2,gemma3-270m]
    python benchmarks/gpu/prepare.py --sdist llama_cpp_python-0.3.36.tar.gz
    python benchmarks/gpu/prepare.py --build-wheel
    python benchmarks/gpu/prepare.py --dry-run [--limit-mib 40]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("ADAPTIVE_LLAMA_GPUKIT", ROOT / ".gpukit"))  # run.py's too
LIMIT_MIB = 64          # what one device call may carry, the working tree included
MARGIN_MIB = 2          # for files the tree gains between now and the calls
DEVICE_PYTHON = "3.12"  # the device image's python3
# Packages llama-cpp-python and adaptive-llama import that the device's image lacks.
DEVICE_WHEELS = ["diskcache==5.6.3"]
# CMake flags for the card: Hopper (H100, H200) only, with the RPC backend the engine expects.
CUDA_CMAKE_ARGS = ("-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_RPC=ON "
                   "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                   "-DGGML_BMI2=ON -DLLAVA_BUILD=OFF")
# What llama.cpp's CMake build needs of the vendored tree (the rest: tests, models, docs, UI).
SDIST_KEEP = ("CMakeLists.txt", "cmake/", "ggml/", "src/", "include/", "common/", "vendor/",
              "licenses/", "LICENSE", "build-info.sh", "tools/CMakeLists.txt")
SDIST_DROP = ("ggml/src/ggml-vulkan/", "ggml/src/ggml-sycl/", "ggml/src/ggml-cann/",
              "ggml/src/ggml-musa/", "ggml/src/ggml-opencl/", "ggml/src/ggml-webgpu/",
              "ggml/src/ggml-hexagon/", "ggml/src/ggml-zdnn/", "ggml/src/ggml-metal/",
              "ggml/src/ggml-kompute/")


def tree_mib() -> float:
    """MiB of the working tree that travels with every call (tracked and untracked files
    that git does not ignore)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((ROOT / n.decode()).stat().st_size for n in names
                if n and (ROOT / n.decode()).is_file())
    return total / 2**20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def trimmed_sdist(sdist: Path, out: Path) -> Path:
    """llama-cpp-python's source with only what its CMake build reads of llama.cpp."""
    target = out / sdist.name.replace(".tar.gz", "-trimmed.tar.gz")
    with tarfile.open(sdist) as src, tarfile.open(target, "w:gz") as dst:
        for member in src.getmembers():
            parts = member.name.split("/", 1)
            inner = parts[1] if len(parts) > 1 else ""
            if inner.startswith("vendor/llama.cpp/"):
                rel = inner.removeprefix("vendor/llama.cpp/")
                if not rel.startswith(SDIST_KEEP) or rel.startswith(SDIST_DROP):
                    continue
            elif inner.startswith((".git/", "docs/", "examples/", "tests/", "docker/")):
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return target


def slim_wheel(wheel: Path, out: Path) -> Path:
    """The wheel with what loading llama.cpp from Python needs only: the llama_cpp package,
    libllama.so (what llama_cpp opens) and the libraries by their sonames (what the others
    link, and what adaptive_llama opens). scikit-build-core's wheel holds every library six
    times (two folders, three names; a 60 MB libggml-cuda for one GPU generation), plus
    headers and libmtmd. RECORD is written anew."""
    target = out / wheel.name
    if target.resolve() == wheel.resolve():
        raise ValueError(f"{wheel}: the slimmed wheel would overwrite it; give another folder")
    kept = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for name in src.namelist():
            folder, _, file = name.rpartition("/")
            if name == record:
                continue
            if folder == "llama_cpp/lib":
                if not (file == "libllama.so" or (file.startswith("libggml")
                                                  and file.endswith(".so.0"))):
                    continue
            elif not name.startswith(("llama_cpp/", record.rpartition("/")[0] + "/")):
                continue
            data = src.read(name)
            info = src.getinfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            kept.append(f"{name},sha256={digest.decode()},{len(data)}")
        dst.writestr(record, "\n".join(kept + [f"{record},,"]) + "\n")
    return target


def build_wheel(out: Path) -> Path:
    """llama-cpp-python built here with CUDA for the card (needs nvcc and cuBLAS's headers
    and libraries; no GPU)."""
    if not shutil.which("nvcc"):
        sys.exit("--build-wheel needs a CUDA compiler (nvcc): give --wheel or --sdist instead")
    missing = missing_cuda_parts(Path(os.path.realpath(shutil.which("nvcc"))).parents[1])
    if missing:
        sys.exit(f"--build-wheel: the CUDA toolkit here lacks {', '.join(missing)} "
                 "(docs/gpu.md, 'The GPU kit', says where to get them)")
    version = _llama_version()
    env = dict(os.environ, CMAKE_ARGS=CUDA_CMAKE_ARGS,
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                    "-w", str(out), f"llama-cpp-python=={version}"], env=env, check=True)
    return next(out.glob(f"llama_cpp_python-{version}-*.whl"))


def missing_cuda_parts(toolkit: Path) -> list[str]:
    """What llama.cpp's CUDA build links that a toolkit without a GPU driver may lack:
    cuBLAS (headers and library) and the driver's libcuda (a stub does for linking)."""
    libs = [toolkit / folder for folder in ("lib64", "lib", "lib64/stubs", "lib/stubs")]
    wanted = {"cublas_v2.h": [toolkit / "include"], "libcublas.so": libs, "libcuda.so": libs}
    return [name for name, folders in wanted.items()
            if not any((folder / name).exists() for folder in folders)]


def _llama_version() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith("llama_cpp_python=="):
            return line.split("==")[1].strip()
    sys.exit("constraints.txt names no llama_cpp_python version")


def device_wheels(out: Path) -> list[Path]:
    """The wheels of DEVICE_WHEELS for the device's Python (pure Python, any platform)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", DEVICE_PYTHON, "-d", str(out),
                    *DEVICE_WHEELS], check=True)
    return sorted(out.glob("*.whl"))


def model_files(names: list[str]) -> list[Path]:
    sys.path.insert(0, str(ROOT))
    from adaptive_llama.runtime.models import BUNDLED

    paths = []
    for name in names:
        if name not in BUNDLED:
            sys.exit(f"no bundled model {name!r}: choose from {', '.join(BUNDLED)}")
        if not BUNDLED[name].installed():
            sys.exit(f"the model {name} is not installed here: pip install "
                     f"'adaptive-llama[{BUNDLED[name].extra}]'")
        paths.append(Path(BUNDLED[name].path()))
    return paths


def plan_calls(items: list[tuple[str, Path]], per_call: int) -> list[list[dict]]:
    """Cut the items, in order, into pieces of at most ``per_call`` bytes per call."""
    calls, room = [[]], per_call
    for kind, path in items:
        size, offset, index = path.stat().st_size, 0, 0
        while offset < size or (size == 0 and index == 0):
            if room <= 0:
                calls.append([])
                room = per_call
            take = min(room, size - offset)
            calls[-1].append({"kind": kind, "name": path.name, "source": str(path),
                              "offset": offset, "length": take, "part": index})
            offset, room, index = offset + take, room - take, index + 1
            if size == 0:
                break
    return calls


def write_calls(calls: list[list[dict]], items: list[tuple[str, Path]]) -> dict:
    manifest = {"items": [{"kind": kind, "name": path.name, "size": path.stat().st_size,
                           "sha256": sha256(path),
                           "parts": sum(1 for c in calls for p in c if p["name"] == path.name)}
                          for kind, path in items]}
    for number, pieces in enumerate(calls, 1):
        folder = KIT / f"call-{number:02d}"
        folder.mkdir(parents=True)
        for piece in pieces:
            with open(piece["source"], "rb") as src, \
                    open(folder / f"{piece['name']}.part{piece['part']:03d}", "wb") as dst:
                src.seek(piece["offset"])
                remaining = piece["length"]
                while remaining:
                    block = src.read(min(remaining, 1 << 22))
                    dst.write(block)
                    remaining -= len(block)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a llama-cpp-python wheel built with CUDA")
    parser.add_argument("--build-wheel", action="store_true", help="build the wheel here")
    parser.add_argument("--sdist", type=Path,
                        help="llama-cpp-python's source, built there (with a wheel too: only "
                             "if the wheel does not load there)")
    parser.add_argument("--dry-run", action="store_true",
                        help="for this CPU: the installed llama-cpp-python, no downloads")
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--limit-mib", type=float, default=None,
                        help=f"what one call carries, the tree included (default {LIMIT_MIB}; "
                             "with --dry-run the tree plus 40, so that a model is cut in parts)")
    args = parser.parse_args(argv)
    if not (args.wheel or args.build_wheel or args.sdist or args.dry_run):
        parser.error("give --wheel, --build-wheel or --sdist (or --dry-run)")
    if args.limit_mib is None:
        args.limit_mib = tree_mib() + 40 if args.dry_run else LIMIT_MIB

    shutil.rmtree(KIT, ignore_errors=True)
    staging = KIT / "staging"
    staging.mkdir(parents=True)
    items: list[tuple[str, Path]] = []
    if args.wheel or args.build_wheel:
        # built into a folder of its own: the slimmed wheel has the same name
        items.append(("llama-wheel", slim_wheel(args.wheel or build_wheel(staging / "built"),
                                                staging)))
    if args.sdist:
        items.append(("llama-sdist", trimmed_sdist(args.sdist, staging)))
    if not args.dry_run:
        items += [("wheel", w) for w in device_wheels(staging / "wheels")]
    models = [m for m in args.models.split(",") if m]
    items += [(f"model:{name}", path) for name, path in zip(models, model_files(models))]

    per_call = int((args.limit_mib - tree_mib() - MARGIN_MIB) * 2**20)
    if per_call < 2**20:
        sys.exit(f"the working tree alone takes {tree_mib():.1f} MiB of the {args.limit_mib:g} "
                 "MiB a call carries: keep what the device does not need out of it (untrack "
                 "and ignore the evaluation's generations while the calls run: docs/gpu.md)")
    calls = plan_calls(items, per_call)
    manifest = write_calls(calls, items)
    shutil.rmtree(staging)
    manifest["calls"] = [f".gpukit/call-{n:02d}" for n in range(1, len(calls) + 1)]
    manifest["dry_run"] = args.dry_run
    (KIT / "plan.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(calls)} device calls, {per_call / 2**20:.1f} MiB each at most "
          f"(the tree takes {tree_mib():.1f} MiB):")
    for n, folder in enumerate(manifest["calls"], 1):
        last = n == len(calls)
        print(f"  run carry=[{folder!r}] command='python3 benchmarks/gpu/run.py"
              f"{'' if last else ' --receive-only'}'" + (" timeout_s=600" if last else ""))


if __name__ == "__main__":
    main()
