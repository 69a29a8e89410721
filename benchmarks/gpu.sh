#!/usr/bin/env bash
# Backend sampling on a CUDA GPU (issue #17), run as it is by someone with an NVIDIA GPU, the
# CUDA toolkit (nvcc) and a C compiler: builds llama-cpp-python with CUDA in a fresh virtual
# environment, runs the test suite with every layer offloaded, then measures decode tokens/s of
# greedy and adaptive with the chain on the CPU and inside the graph, on both bundled models
# and on Qwen2.5-Coder-1.5B, one sequence and 8 together (what `serve --parallel 8` decodes).
# Results: benchmarks/results/gpu/*.json and the log; put the figures in models.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/gpu
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1

nvidia-smi
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
python -m pip install --upgrade pip
# The CUDA build of the llama.cpp that adaptive-llama is written against (pyproject's range).
CMAKE_ARGS="-DGGML_CUDA=on" FORCE_CMAKE=1 python -m pip install --no-cache-dir \
    --no-binary llama-cpp-python "llama-cpp-python>=0.3.36,<0.3.37"
python -m pip install -e ".[test,bench,qwen]"
python -m pip install --no-deps exllamav2==0.3.2   # the evaluation's text stand-ins, as make test does

# The whole suite with the test engines fully offloaded (backend sampling then runs on CUDA).
# If loading a model segfaults, numpy was imported before llama_cpp on a system where that order
# breaks (seen on an H100 image, models.md): rerun with LD_PRELOAD=<the libgomp.so.1 llama.cpp links>.
ADAPTIVE_LLAMA_TEST_GPU_LAYERS=-1 python -m pytest -q tests

for parallel in 1 8; do
    python benchmarks/bench_graph.py --n-gpu-layers -1 --rounds 7 --tokens 256 \
        --parallel "$parallel" > "$OUT/bench_graph_p$parallel.json"
    python benchmarks/bench_graph.py --n-gpu-layers -1 --rounds 7 --tokens 256 \
        --parallel "$parallel" --model qwen2.5-coder-1.5b > "$OUT/bench_graph_qwen_p$parallel.json"
done
# The host's share of a token: greedy through llama.cpp's chain against choosing from the row.
python benchmarks/bench_row.py --rounds 9 > "$OUT/bench_row.json"
python - <<'PY'
import json, pathlib
for f in sorted(pathlib.Path("benchmarks/results/gpu").glob("bench_graph*.json")):
    for model, r in json.loads(f.read_text())["results"].items():
        for key, row in r.items():
            if key.startswith("parallel_"):
                print(f.name, model, key, row["tokens_per_s"],
                      "adaptive in graph / greedy in graph:",
                      row["adaptive_in_graph_over_greedy_in_graph"], "(target >= 0.98)")
PY
