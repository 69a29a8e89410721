"""``adaptive-llama eval``: the paper's evaluation (Zhu et al., ICML 2024, 5.1), offline.

- :mod:`.run`: the configuration and the :class:`~.run.Evaluator` (generation, scoring);
- :mod:`.tasks`: open-ended generation, threshold ablation, sampler latency, GSM8K;
- :mod:`.data`: the prompts (offline stand-ins for the paper's data sets, or the user's);
- :mod:`.metrics`: rep-n, diversity, coherence, MAUVE, intervals;
- :mod:`.cache`: the resume cache; :mod:`.report`: results.json, results.md, plots.
"""
