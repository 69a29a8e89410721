"""What one evaluation run does: its tasks, the methods and each method's grid of specs, and
the sizes (:class:`EvalConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..samplers import TEMP, SpecError, parse_spec

# Each method's dev grid: four values for every truncation method (the same tuning budget
# for all, picked by MAUVE on the same dev texts). The first value is each method's usual
# default, kept when the dev split cannot tell the values apart.
GRIDS = {
    "greedy": ["greedy"],
    "top-k": ["top-k:k=40", "top-k:k=10", "top-k:k=20", "top-k:k=80"],
    "top-p": ["top-p:p=0.95", "top-p:p=0.8", "top-p:p=0.9", "top-p:p=0.98"],
    "typical": ["typical:p=0.95", "typical:p=0.2", "typical:p=0.5", "typical:p=0.9"],
    "min-p": ["min-p:p=0.05", "min-p:p=0.02", "min-p:p=0.1", "min-p:p=0.2"],
    "mirostat": ["mirostat:tau=5,eta=0.1", "mirostat:tau=2,eta=0.1", "mirostat:tau=3,eta=0.1",
                 "mirostat:tau=4,eta=0.1"],
    "eta": ["eta:eps=0.0009", "eta:eps=0.0003", "eta:eps=0.002", "eta:eps=0.004"],
    "adaptive": ["adaptive:eps=0.0005", "adaptive:eps=0.0001", "adaptive:eps=0.001",
                 "adaptive:eps=0.005"],
    # Today's rivals: p-less has no parameter to tune (its point), the others four values
    # around their authors' defaults.
    "p-less": ["p-less"],
    "top-h": ["top-h:alpha=0.4", "top-h:alpha=0.2", "top-h:alpha=0.3", "top-h:alpha=0.6"],
    "top-n-sigma": ["top-n-sigma:n=1", "top-n-sigma:n=0.5", "top-n-sigma:n=1.5",
                    "top-n-sigma:n=2"],
    "adaptive-p": ["adaptive-p:target=0.5", "adaptive-p:target=0.3", "adaptive-p:target=0.7",
                   "adaptive-p:target=0.9"],
}
# The methods the temperature study runs at every temperature (the min-p paper's claim is
# about these).
TEMPERATURE_METHODS = ("top-p", "min-p", "eta", "adaptive", "p-less", "top-h", "top-n-sigma",
                       "adaptive-p")

TASKS = ("wiki", "stories", "ablation", "penalties", "latency", "gsm8k")
METHODS = tuple(GRIDS)


@dataclass
class EvalConfig:
    """Sizes of one evaluation run: by default every method gets the same 200 test texts per
    task (64 new tokens each) and the same 64 dev texts for its four grid values."""

    model: str | None = None
    tasks: tuple[str, ...] = TASKS
    methods: tuple[str, ...] = METHODS
    temperatures: tuple[float, ...] = ()
    n_dev: int = 64
    n_test: int = 200
    samples: int = 1
    max_tokens: int = 64
    prefix_tokens: int = 32
    gsm8k_n: int = 10
    gsm8k_max_tokens: int = 160
    # samplers GSM8K runs besides its own (each spec at the temperature it names)
    gsm8k_samplers: tuple[str, ...] = ()
    mauve_seeds: int = 5
    mauve_bootstrap: int = 40
    full: bool = False
    prompts_file: str | None = None
    out: str = "benchmarks/results"
    seed: int = 0
    n_ctx: int = 512
    # texts decoded together: 16 is the fastest of 8, 16 and 32 for SmolLM2 on 2 cores
    # (1.14x 8); larger models gain more from more (Qwen-1.5B: 32 is about 1.6x 8)
    batch: int = 16
    n_threads: int | None = None
    n_gpu_layers: int = 0  # layers offloaded to a GPU (CUDA build; -1: all)
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers holding the layers (HOST:PORT)
    command: str = ""

    @classmethod
    def paper_sizes(cls, **overrides) -> "EvalConfig":
        """The paper's sizes: 1,000 test prefixes x 5 samples of 256 tokens, 200 dev; GSM8K
        answers get 512 tokens (at 256 a 1.5B instruct model's worked answer is cut off about
        half the time, and the cut answer's last number is what gets scored)."""
        return cls(**{"n_dev": 200, "n_test": 1000, "samples": 5, "max_tokens": 256,
                      "gsm8k_n": 200, "gsm8k_max_tokens": 512, "full": True, **overrides})

    def __post_init__(self):
        for name in ("n_dev", "n_test", "samples", "max_tokens", "prefix_tokens", "gsm8k_n",
                     "gsm8k_max_tokens", "mauve_seeds", "mauve_bootstrap", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` has to be >= 1, but is {getattr(self, name)}")
        if self.n_gpu_layers < -1:
            raise ValueError(f"`n_gpu_layers` has to be -1 (all) or more, but is "
                             f"{self.n_gpu_layers}")
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown task {sorted(unknown)[0]!r}; valid: {', '.join(TASKS)}")
        unknown = [m for m in self.methods if m not in GRIDS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method {unknown[0] if unknown else '(none)'!r}; "
                             f"valid: {', '.join(GRIDS)}")
        for temp in self.temperatures:
            TEMP.validate(temp, name="temperature")
        for spec in self.gsm8k_samplers:
            try:
                parse_spec(spec)
            except SpecError as exc:
                raise ValueError(f"--gsm8k-sampler {spec!r}: {exc}") from None
        # the prefix and its continuation fit in one sequence, and so do a GSM8K question
        # in the chat template (up to about 256 tokens) and its answer
        longest = max(self.prefix_tokens + self.max_tokens + 64, 256 + self.gsm8k_max_tokens)
        self.n_ctx = max(self.n_ctx, 256 * -(-longest // 256))
