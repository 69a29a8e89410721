"""Running a model: the engine (:mod:`.engine`: load a GGUF, render its chat template,
generate), continuous batching of many sequences in one context (:mod:`.batching`), the CPU
threads (:mod:`.threads`), bundled models and paths (:mod:`.models`), per-model settings
(:mod:`.config`) and llama.cpp's limits (:mod:`.limits`).

Nothing is imported here: the models, settings and limits load without llama.cpp, so that
the command line starts fast; ``adaptive_llama`` re-exports the public names.
"""
