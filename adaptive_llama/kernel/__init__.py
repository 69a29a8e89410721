r"""The adaptive-decoding kernel: how many candidates to keep at one step.

Adaptive decoding (Zhu et al., "Improving Open-Ended Text Generation via Adaptive Decoding",
ICML 2024, https://arxiv.org/abs/2402.18223, section 4 and Algorithm 1). Sort the next-token
probabilities :math:`p_1 \ge p_2 \ge \dots \ge p_V`, let :math:`c_k = p_1 + \dots + p_k` and
:math:`R_k = 1 - c_k` (the mass not yet placed). With natural logarithms::

    dConf_k = [ p_k ln(p_k (V-k) / R_k)  +  R_{k-1} ln( (R_k/(V-k)) / (R_{k-1}/(V-k+1)) ) ] / ln V

    k* = max(1, the last k with dConf_k > epsilon)

dConf_k is the rise in confidence, Conf = 1 - H / ln V, of the estimated distribution that
knows p_1..p_k and spreads R_k uniformly over the other V - k tokens, when token k becomes
known. The kept set is the prefix p_1..p_{k*}, as in Algorithm 1, even when some dConf before
k* dips below epsilon (the authors' scripts use a mask instead).

Edge semantics:

- V is the length of the logits, masked (``-inf``) tokens included.
- A token with p = 0 never counts (its dConf is not above epsilon).
- Where the tail mass R_k is exactly 0 (every later token masked, and at k = V), dConf_k takes
  its continuous limit ``p_k ln(V-k+1) / ln V``.
- V = 1 gives k* = 1. At a tie on the boundary any prefix of the sorted order is fine: tied
  tokens have equal p, so every order gives the same dConf sequence.

Normalisation: the paper's Conf is base-free (entropy over log V with one base), so natural
logarithms throughout. The authors' first script, ``adaptive.py``, divides natural-log terms
by log2 V: its dConf is the paper's times ln 2, so its epsilon 0.001 is the paper's (and
this module's) 0.00144. Their later transformers warper uses ln V, as here.

Why the fast kernels are O(V) and exact: dConf_k ln V is the drop in estimated entropy when
token k becomes known, R_{k-1} KL(q || uniform over V-k+1 tokens) with q = (p_k/R_{k-1}, rest
uniform). Since p_k is at least the mean of the remaining tokens this is at most
p_k ln(p_k/u) with u = R_{k-1}/(V-k+1) >= p_k/(V-k+1), hence::

    dConf_k <= p_k ln(V-k+1) / ln V <= p_k

so no token with p <= epsilon can be the last index above epsilon. The part of the KL sum
over the V-k other tokens is not positive (q gives each of them at most 1/(V-k+1), because
p_k >= u), which gives the
sharper bound dConf_k ln V <= p_k ln(p_k (V-k+1) / R_{k-1}); the C kernel evaluates it once
for a block of candidates (largest p, smallest R in the block) and passes over blocks that it
keeps below epsilon ln V without computing their dConf. The kernels compute the
max logit, the softmax normaliser, collect the fewer than 1/epsilon tokens with p > epsilon,
sort only those and scan them; the tail masses R_k are float64 sums of the tail itself, never
``1 - c_k`` (which cancels catastrophically once c_k is near 1).

Layout: :mod:`.reference` evaluates this formula in float64, line for line, over the fully
sorted vocabulary (the tests check every fast kernel against it); :mod:`.native` loads the C
implementation (``native/adaptive.c``), :mod:`.numba_impl` is the numba one, and
:mod:`.choice` picks one of them once and holds the array API (:func:`adaptive_k`,
:func:`adaptive_stats`). This package imports nothing else of adaptive_llama but the sampler
table (for epsilon's range).
"""

from .checks import validate_epsilon
from .choice import BACKEND, IMPL, AdaptiveStats, adaptive_k, adaptive_stats
from .reference import adaptive_k_reference, dconf_of_head, dconf_reference, k_from_dconf

__all__ = ["AdaptiveStats", "BACKEND", "IMPL", "adaptive_k", "adaptive_k_reference",
           "adaptive_stats", "dconf_of_head", "dconf_reference", "k_from_dconf",
           "validate_epsilon"]
