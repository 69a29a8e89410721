"""Limits that llama.cpp sets, for the checks at every entry point (command line, config
file, Python API); importing this module loads nothing else."""

# ggml's GGML_MAX_N_THREADS: its thread pool and CPU masks hold this many threads; more
# ran thousands of threads or crashed inside ggml.
MAX_THREADS = 512

# The longest context window taken, in tokens: beyond every model's trained context (the
# longest, Llama 4 Scout's, is 10M). llama.cpp holds n_ctx in 32 bits: a larger value
# wrapped around, and one near it had llama.cpp try to allocate for tens of seconds.
MAX_CTX = 2**24
MAX_DEVICES = 16  # llama.cpp's LLAMA_MAX_DEVICES: settings are checked against it without
# loading llama.cpp; the engine checks the loaded build's own (llama_max_devices)
N_BATCH = 512  # tokens per llama_decode call at most (prompt chunks and generating rows)
