"""Limits that llama.cpp sets, for the checks at every entry point (command line, config
file, Python API); importing this module loads nothing else."""

# ggml's GGML_MAX_N_THREADS: its thread pool and CPU masks hold this many threads; more
# ran thousands of threads or crashed inside ggml.
MAX_THREADS = 512
