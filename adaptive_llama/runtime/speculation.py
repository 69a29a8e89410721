"""Speculative decoding's state: the drafter, what rows cost, each sequence's drafts and how
long they are, and each step's round of drafts.

The decoder (:mod:`adaptive_llama.runtime.batching`) puts a sequence's drafted tokens in the
batch after the token it feeds, and samples the target's own chain at each position in turn:
a draft is kept while it equals the token the chain chose, and the first difference ends the
round with the chain's token (llama.cpp's rule, common/sampling.cpp). Every token of a reply
is therefore a sample of the target's chain, drawn with the same random numbers as without
speculation; where the model computes a row the same way in any batch (the CPU:
:mod:`adaptive_llama.llama.cpu_attention`), the reply is the same text. The drafters are in
:mod:`adaptive_llama.runtime.drafting`.

**How long a draft is** (:class:`DraftLength`). A draft of n tokens yields ``1 + S(1) + ... +
S(n)`` tokens on average, ``S(j)`` being the chance that its first j tokens are all kept;
it costs ``1 + c(n)`` single-token decodes, ``c(n)`` being what n more rows (and drafting
them) add to a step, as measured (:class:`RowCost`). Each sequence drafts the n that yields
most per cost, and none where no draft promises ``MIN_GAIN`` (10%) more tokens per cost than
decoding alone: the rates come from the last few dozen tokens, and right after a run of kept
drafts, which is where drafting starts, they overstate what the next draft keeps (on 2 cores
with SmolLM2, chat at temperature 0.7, drafts that promised less cost 2 to 4% and won
nothing). ``S(j)`` is the product of the rates ``h(i)`` at which the i-th drafted token was
kept given the ones before it were, counted per position: drafts that copy a passage tend
to be kept whole once their first tokens are, which one rate for every position would miss.
Each count weighs 5% less with every token the sequence makes after it: what the next draft
keeps depends on the text of late, not on the last few drafts (a rule that forgot once per
draft forgot slowest where drafts are long, and after one miss in a copied passage held
back for half of a code edit).

**Acceptance without paying for it.** A drafter whose drafts cost nothing worth counting
(prompt lookup) drafts its longest at every step, whatever part of it the batch verifies, and
each such draft is compared with the tokens the sequence then makes: they are the tokens
verification chose or would have chosen. Every step's draft counts as a round of its own,
settled token by token as the sequence goes on, several at once. So every position's rate
is measured at every step where the rule decides, also past the drafts' current length and
while nothing is drafted: a rule that learnt the far positions only from drafts that reach
them would grow into long drafts slowly (on a code edit with Qwen2.5-Coder-1.5B it took 16
steps, a third of the reply), and one that waited for a draft to settle before the next
would count mostly the steps after a draft failed, and expect too little. A drafter that
costs (a draft model) instead drafts one token after ``PROBE_EVERY`` idle rounds (then twice
as many, up to 64), so that it notices when drafts start to pay again.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Protocol

from .prefix import shared_prefix

MAX_DRAFT = 16           # tokens per round at most (llama.cpp's --draft-max default)
MIN_GAIN = 1.1           # tokens per cost a draft has to promise (see DraftLength)
PROBE_EVERY = 8          # rounds between one-token drafts while drafting does not pay,
MAX_PROBE_EVERY = 64     # doubling after each probe up to this
POSITION_WEIGHT = 2.0    # a position's own rate weighs in after this many rounds reached it
# A row count's time not measured again for this many steps is forgotten: a cost measured
# at another context length (a long prompt's rows cost more), or in a burst of noise, would
# otherwise keep a length from being tried ever again.
MAX_AGE = 64


class DraftState(Protocol):
    """A drafter's view of one sequence: its tokens so far."""

    tokens: list[int]

    def extend(self, tokens: list[int]) -> None: ...


class Drafter(Protocol):
    """What proposes tokens for speculation (:mod:`adaptive_llama.runtime.drafting`)."""

    name: str      # "ngram" or the draft model's file
    draft_s: float  # seconds per drafted token, as measured (0 for a lookup)
    free: bool     # drafting costs nothing worth counting: its longest, every step

    def start(self, slot: int, tokens: list[int]) -> DraftState:
        """The state of a sequence that starts in ``slot`` with ``tokens``."""

    def draft(self, wants: list[tuple[int, DraftState, int]]) -> list[list[int]]:
        """Drafts for (slot, state, tokens wanted) of several sequences."""

    def close(self) -> None: ...


@dataclass
class SequenceDraft:
    """One sequence's part of a round: the token it feeds at batch row ``first_row``, its
    drafted tokens in the rows after it, and how verification went."""

    generation: object     # a batching.Generation
    draft: list[int]
    first_row: int
    kept: int = 0          # drafted tokens the chain chose too
    checked: int = 0       # drafted tokens compared (not those after the first difference)

    @property
    def rows(self) -> int:
        return 1 + len(self.draft)

    @property
    def next_row(self) -> int:
        """The batch row whose logits choose the sequence's next token."""
        return self.first_row + self.kept

    def accepts(self, token: int) -> bool:
        """Compare the chain's choice with the next drafted token: whether it was kept (the
        sequence's next token then comes from the next row)."""
        if self.kept == len(self.draft):
            return False
        self.checked += 1
        if token != self.draft[self.kept]:
            return False
        self.kept += 1
        return True


@dataclass
class DraftRound:
    """One step's batch of sequences and their drafts (as vLLM's SpecDecodeMetadata)."""

    sequences: list[SequenceDraft]

    @classmethod
    def of(cls, generating: list, drafts: list[list[int]]) -> "DraftRound":
        sequences, row = [], 0
        for generation, draft in zip(generating, drafts):
            sequences.append(SequenceDraft(generation, draft, row))
            row += 1 + len(draft)
        return cls(sequences)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sequences)

    @property
    def drafted(self) -> bool:
        return any(s.draft for s in self.sequences)


@dataclass
class DraftLength:
    """How many tokens one sequence drafts next (see the module docstring)."""

    n_max: int = MAX_DRAFT
    probes: bool = True     # one-token probes while drafts do not pay (drafters that cost)
    # decaying counts over every position: a prior of one kept in two
    drafted: float = 2.0
    accepted: float = 1.0
    reached: list[float] = field(default=None)  # per position j: rounds that checked it
    kept: list[float] = field(default=None)     # of them, those that kept it
    idle_rounds: int = 0    # rounds without a draft since the last one
    probe_every: int = PROBE_EVERY

    DECAY = 0.95  # the counts weigh this much less with each token the sequence makes

    def __post_init__(self):
        self.reached = [0.0] * self.n_max
        self.kept = [0.0] * self.n_max

    @property
    def rate(self) -> float:
        """The share of drafted tokens kept, over every position."""
        return self.accepted / self.drafted

    # survival() and next_length() run at every step of every drafting sequence, in plain
    # floats: on 16 entries numpy's calls cost more than the arithmetic (about 150 us a step
    # with the caches cold from a decode; a GPU's step takes about 1 ms).
    def survival(self) -> list[float]:
        """S(j) for j = 1..n_max: the chance that a draft's first j tokens are all kept. Each
        position's rate is its own counts with POSITION_WEIGHT rounds at the overall rate."""
        prior = POSITION_WEIGHT * self.rate
        chance, chances = 1.0, []
        for kept, reached in zip(self.kept, self.reached):
            chance *= min((kept + prior) / (reached + POSITION_WEIGHT), 1.0)
            chances.append(chance)
        return chances

    def next_length(self, costs: list[float]) -> int:
        """The draft length that yields most tokens per cost, ``costs[n - 1]`` being what n
        drafted rows add to a step, relative to decoding one token (at least ``n_max``
        entries). Where none pays: nothing, or for a drafter that costs, a one-token probe
        now and then, less often while probes keep failing."""
        expected, best, length = 1.0, MIN_GAIN, 0
        for n, (chance, cost) in enumerate(zip(self.survival(), costs), 1):
            expected += chance
            gain = expected / (1.0 + cost)
            if gain > best:
                best, length = gain, n
        if length:
            self.probe_every = PROBE_EVERY
            return length
        if not self.probes:
            return 0
        self.idle_rounds += 1
        if self.idle_rounds < self.probe_every:
            return 0
        self.idle_rounds = 0
        self.probe_every = min(self.probe_every * 2, MAX_PROBE_EVERY)
        return 1

    def forget(self, tokens: int) -> None:
        """The sequence made ``tokens`` more: every count weighs less."""
        decay = self.DECAY ** tokens
        self.drafted *= decay
        self.accepted *= decay
        self.reached = [r * decay for r in self.reached]
        self.kept = [k * decay for k in self.kept]

    def record(self, checked: int, kept: int, known: int = 0) -> None:
        """A draft of which ``checked`` tokens were compared and the first ``kept`` kept, the
        first ``known`` of them recorded before (a draft settled as its tokens are made)."""
        if checked <= known:
            return
        self.drafted += checked - known
        self.accepted += kept - known
        self.reached = [r + (known <= j < checked) for j, r in enumerate(self.reached)]
        self.kept = [k + (known <= j < kept) for j, k in enumerate(self.kept)]


class RowCost:
    """What drafted rows add to a decode step, from running averages of the step's time by
    its number of rows, each forgotten when not measured again within ``MAX_AGE`` steps. A
    row count not measured is interpolated between the nearest measured ones, and past the
    largest taken to cost ``prior`` of a sequence's share of the step a row: the least a
    row may cost, so that a length the drafts' rates say could pay is tried and measured
    (on a GPU 16 rows cost not much more than one; on a CPU bound by arithmetic they cost
    about 10 single-row decodes, but the first drafted row can cost the most of all: on 2
    cores with Qwen2.5-Coder-1.5B one decode of 1, 2, 4 and 16 rows took 40, 86, 124 and 439
    ms, and a line through what was measured kept drafts at one token, where 16 pay 1.27x).
    Drafts grow into what was not measured step by step: at most one more than twice the
    most drafted rows measured, so that finding out what rows cost never costs a step of 16
    rows that pays nothing. Until
    a step of the plain rows was measured, drafts are taken to cost without bound: that
    step comes first.

    A drafted step also costs the step after it: llama.cpp builds its graph again for the
    new number of rows (on CUDA the CUDA graph warms up again), so a step with fewer rows
    than the one before takes longer than its kind (measured on 2 cores with SmolLM2: 1.3 ms
    on an 11.7 ms step, a fifth of what a drafted row adds). That excess is averaged apart
    (``return_s``), kept out of the plain step's time and added to every draft's cost. It
    is measured on the plain steps alone: a drafted row count is measured seldom, and its
    step's excess over that noisy average (a fifth of the runs of a SmolLM2 code edit put
    the excess at 5 to 10 ms, where it is 1 to 2) made every draft look a decode dearer. The
    step after a prompt chunk is not counted at all: its graph is built again too, and no
    draft caused it."""

    def __init__(self, prior: float = 0.1):
        self.step_s: dict[int, float] = {}  # rows in the step -> seconds, running average
        self.return_s: float | None = None  # a step's excess after a step of more rows
        self.prior = prior
        self._steps = 0
        self._measured: dict[int, int] = {}  # rows -> the step it was last measured at
        self._last_rows = 0         # the rows of the step before
        self._after_prompt = False  # a prompt chunk was decoded since

    def reshaped(self) -> None:
        """A decode that is not a step (a prompt chunk) ran."""
        self._after_prompt = True

    def observe(self, seconds: float, rows: int, plain_rows: int = 1) -> None:
        """A step of ``rows`` rows took ``seconds``; ``plain_rows``: the step's sequences."""
        self._steps += 1
        after_prompt, self._after_prompt = self._after_prompt, False
        returning = plain_rows == rows < self._last_rows and rows in self.step_s
        self._last_rows = rows
        if after_prompt:
            return
        if returning:
            self.return_s = average(self.return_s, seconds - self.step_s[rows])
            seconds -= self.return_s
        self.step_s[rows] = average(self.step_s.get(rows), seconds)
        self._measured[rows] = self._steps
        for stale in [r for r, step in self._measured.items()
                      if self._steps - step > MAX_AGE]:
            del self.step_s[stale], self._measured[stale]

    def extra(self, sequences: int, n_max: int, draft_s: float = 0.0) -> list[float]:
        """What 1, 2, ..., ``n_max`` more rows (and drafting them, ``draft_s`` seconds each)
        add to a step of ``sequences`` single rows and to the plain step after it, in units
        of one sequence's share of that step; inf past what may be tried yet. In plain
        floats, as DraftLength.next_length."""
        plain = self.step_s.get(sequences)
        if plain is None:
            return [math.inf] * n_max
        share = plain / sequences
        returning = max(self.return_s or 0.0, 0.0)
        tried = max(self.step_s) - sequences  # the most drafted rows measured
        return [(seconds - plain + returning + n * draft_s) / share
                if n <= 2 * tried + 1 else math.inf
                for n, seconds in enumerate(self._times(sequences, n_max, share), 1)]

    def _times(self, sequences: int, n_max: int, share: float) -> list[float]:
        """Step times of ``sequences`` + 1 to + ``n_max`` rows: interpolated between the
        measured row counts, past the largest at ``prior`` of a share a row."""
        measured = sorted(self.step_s)
        seconds = [self.step_s[r] for r in measured]
        slope = self.prior * share
        times = []
        for rows in range(sequences + 1, sequences + n_max + 1):
            above = bisect.bisect_right(measured, rows)
            if above == len(measured):
                times.append(seconds[-1] + slope * (rows - measured[-1]))
            else:  # measured[above - 1] <= rows < measured[above]: the plain rows are measured
                low, high = measured[above - 1], measured[above]
                times.append(seconds[above - 1] + (seconds[above] - seconds[above - 1])
                             * (rows - low) / (high - low))
        return times


def average(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class _Pending:
    """A free drafter's whole draft, compared with the tokens made after it."""

    draft: list[int]
    start: int      # the generation's token count when it was drafted
    known: int = 0  # of its tokens, those recorded as kept so far

    def settle(self, made: list[int], length: DraftLength) -> bool:
        """Record in ``length`` what the tokens made since settle; whether the draft is
        settled (a token differs, or every drafted token was made)."""
        since = made[self.start + self.known:self.start + len(self.draft)]
        kept = self.known + shared_prefix(self.draft[self.known:], since)
        if kept == self.known + len(since) and kept < len(self.draft):
            length.record(kept, kept, self.known)
            self.known = kept  # a prefix that agrees only grows
            return False
        length.record(min(kept + 1, len(self.draft)), kept, self.known)
        return True


@dataclass
class _Sequence:
    """Speculation's record of one generating sequence."""

    state: DraftState
    length: DraftLength
    made: int = 0                 # of the generation's tokens, those the state holds
    counted: int = 0              # of them, those the counts were decayed for
    pending: list[_Pending] = field(default_factory=list)  # oldest first


class Speculation:
    """Drafting for a decoder: the drafter, the cost of rows, and each sequence's draft
    state and length rule (see the module docstring). ``fixed`` (benchmarks) sets aside the
    length rule: every round then drafts that many tokens where the drafter has them."""

    def __init__(self, drafter: Drafter, draft_max: int = MAX_DRAFT):
        self.drafter = drafter
        self.draft_max = draft_max
        self.row_cost = RowCost()
        self.fixed: int | None = None
        self._plain_rows = 1  # the last round's sequences
        self._sequences: dict[int, _Sequence] = {}  # by the generation's slot

    @property
    def name(self) -> str:
        return self.drafter.name

    def start(self, slot: int, prompt: list[int]) -> None:
        """A sequence starts in ``slot`` with ``prompt``."""
        self._sequences[slot] = _Sequence(self.drafter.start(slot, prompt),
                                          DraftLength(self.draft_max,
                                                      probes=not self.drafter.free))

    def end(self, slot: int) -> None:
        self._sequences.pop(slot, None)

    def observe(self, seconds: float, rows: int) -> None:
        """A decode step of ``rows`` rows took ``seconds``."""
        self.row_cost.observe(seconds, rows, self._plain_rows)

    def prompt_evaluated(self) -> None:
        """A prompt chunk was decoded between steps."""
        self.row_cost.reshaped()

    def plan(self, generating: list, room: int, left: list[int]) -> DraftRound:
        """This step's round: a draft for each generating sequence, at most ``room`` drafted
        tokens in all and ``left[i]`` for the i-th sequence. A free drafter drafts its
        longest first, and only a sequence that has a draft asks the rule how much of it to
        verify: most steps of a chat have none, and the rule costs about as much as the
        lookup and the shadow's bookkeeping together (some 30 us a step)."""
        records = [self._caught_up(generation) for generation in generating]
        self._plain_rows = len(generating)
        free = self.drafter.free
        if free:
            drafts = self.drafter.draft([(g.slot.index, r.state, self.draft_max)
                                         for g, r in zip(generating, records)])
            self._shadow(generating, drafts)
            left = [min(limit, len(draft)) for draft, limit in zip(drafts, left)]
        lengths, costs = [], None
        for record, limit in zip(records, left):
            if (free and limit <= 0) or self.fixed is not None:
                n = self.fixed or 0
            else:
                costs = costs or self.row_cost.extra(len(generating), self.draft_max,
                                                     self.drafter.draft_s)
                n = record.length.next_length(costs)
            n = max(0, min(n, limit, room))
            room -= n
            lengths.append(n)
        if free:
            drafts = [draft[:n] for draft, n in zip(drafts, lengths)]
        else:
            drafts = self.drafter.draft([(g.slot.index, r.state, n)
                                         for g, r, n in zip(generating, records, lengths)])
        return DraftRound.of(generating, drafts)

    def _caught_up(self, generation) -> _Sequence:
        """The sequence's record, its state given the tokens made since the last round."""
        record = self._sequences[generation.slot.index]
        made = generation.result.tokens
        if record.made < len(made):
            record.state.extend(made[record.made:])
            record.made = len(made)
        return record

    def _shadow(self, generating: list, drafts: list[list[int]]) -> None:
        """For each sequence: settle its pending drafts against the tokens made since each
        was drafted, and add this step's whole draft to them."""
        for generation, draft in zip(generating, drafts):
            record = self._sequences[generation.slot.index]
            made = generation.result.tokens
            record.length.forget(len(made) - record.counted)
            record.counted = len(made)
            record.pending = [pending for pending in record.pending
                              if not pending.settle(made, record.length)]
            if draft and not (record.pending and record.pending[-1].start == len(made)):
                record.pending.append(_Pending(draft, len(made)))  # one per place drafted from

    def finish(self, round_: DraftRound) -> None:
        """After verification: each sequence's counts."""
        for sequence in round_.sequences:
            if not sequence.draft:
                continue
            generation = sequence.generation
            record = self._sequences.get(generation.slot.index)
            if record is not None and not self.drafter.free:  # else settled as a shadow
                record.length.forget(sequence.kept + 1)
                record.length.record(sequence.checked, sequence.kept)
            generation.result.draft_tokens += sequence.checked
            generation.result.draft_accepted += sequence.kept

    def close(self) -> None:
        self.drafter.close()

