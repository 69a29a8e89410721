"""Adaptive decoding inside llama.cpp's graph (backend sampling): the ggml operations against
the float64 reference, then whole generations through llama.cpp on the bundled model."""

import ctypes
import json
import re
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import GPU_LAYERS
from test_cli import run_cli
from test_kernel import (
    FOUR,
    FOUR_CASES,
    MASKED,
    MASKED_CASES,
    ROWS,
    TWO,
    TWO_CASES,
    logits_of,
)
from test_server import raw, serving

from adaptive_llama import Engine
from adaptive_llama.cli import main
from adaptive_llama.kernel import adaptive_k_reference, dconf_of_head, dconf_reference
from adaptive_llama.llama import ggml, graph
from adaptive_llama.runtime import config
from adaptive_llama.samplers import SpecError

# The numba pass of `make test` runs these again (tests/test_marks.py).
pytestmark = pytest.mark.backend

# float32 logarithms put dConf within ~1e-7 (absolute, times ln V) of its float64 value: an
# answer may differ from the reference only where some dConf lies this close to epsilon.
GRAPH_REL = 1e-4


def kept(logits, eps, uniform=False):
    """(k, the kept token ids in descending order of p, the K outputs) from the graph."""
    out, ids = graph.evaluate(logits, eps, uniform)
    finite = np.isfinite(out)
    k = int(finite.sum())
    assert finite[len(out) - k:].all(), "the kept tokens are the last k, in ascending order"
    return k, ids[len(out) - k:][::-1], out


def reference_k(x, eps):
    """The float64 reference on the float32 logits the graph sees."""
    return adaptive_k_reference(np.asarray(x, np.float32).astype(np.float64), eps)


def near_boundary(x, eps):
    d = dconf_reference(np.asarray(x, np.float32).astype(np.float64))
    return bool(np.any(np.abs(d[np.isfinite(d)] - eps) <= GRAPH_REL * eps))


# ---- layer 1: the hand-worked distributions of test_kernel (arithmetic there) ----

@pytest.mark.parametrize("p,cases", [(FOUR, FOUR_CASES), (MASKED, MASKED_CASES), (TWO, TWO_CASES)])
@pytest.mark.parametrize("uniform", [False, True])
def test_hand_worked_thresholds(p, cases, uniform):
    x = logits_of(p)
    for eps, expected in cases:
        k, ids, out = kept(x, eps, uniform)
        assert k == expected, eps
        # Ties (MASKED's two 0.5s) may come in either order; otherwise most likely first.
        assert sorted(ids) == sorted(np.argsort(-np.asarray(p), kind="stable")[:k]), eps
        if uniform:
            assert np.all(out[np.isfinite(out)] == 0)
        else:
            np.testing.assert_allclose(np.exp(out[-k:][::-1]), np.asarray(p)[ids], rtol=1e-6)


def test_vocabulary_of_one_and_flat_rows_keep_one_token():
    assert kept(np.array([3.0]), 0.001)[0] == 1
    assert kept(np.zeros(50_000), 0.0005)[0] == 1  # p = 2e-5 < eps everywhere


def test_tiny_epsilon_sorts_the_whole_vocabulary_and_keeps_every_possible_token():
    x = np.log(np.r_[np.full(20, 0.04), np.full(20, 0.01)])  # dConf of the last > 1e-6
    x[[3, 30]] = -np.inf
    k, ids, out = kept(x, 1e-6)
    assert out.size == x.size and k == 38 and {3, 30}.isdisjoint(ids)


def test_the_most_likely_token_is_last_so_dist_can_never_fall_on_a_cut_one():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 4, 5000)
    out, ids = graph.evaluate(x, 0.01)
    assert ids[-1] == np.argmax(x) and np.isfinite(out[-1]) and np.isneginf(out[0])


# ---- layer 2: seeded random rows of every shape against the float64 reference ----

def test_graph_matches_reference_on_random_rows():
    mismatches, near = [], 0
    for i, (kind, x, eps) in enumerate(ROWS):
        k = kept(x, eps)[0]
        if k != reference_k(x, eps):
            if near_boundary(x, eps):
                near += 1
                continue
            mismatches.append((i, kind, x.size, eps, k, reference_k(x, eps)))
    assert not mismatches, mismatches[:5]
    assert near <= 5


def test_kept_mass_matches_reference():
    for kind, x, eps in ROWS[:200]:
        k, _, out = kept(x, eps)
        x64 = np.sort(np.asarray(x, np.float32).astype(np.float64))[::-1]
        p = np.exp(x64 - x64[0])
        p /= p.sum()
        if k == reference_k(x, eps):
            mass = np.exp(out[np.isfinite(out)].astype(np.float64)).sum()
            assert mass == pytest.approx(p[:k].sum(), rel=2e-5), kind


# ---- layer 3: generation through llama.cpp with the bundled model ----

@pytest.fixture(scope="module")
def graph_engine(smollm2_path):
    eng = Engine(smollm2_path, seed=1, n_ctx=512, parallel=2, backend_sampling=True,
                 n_gpu_layers=GPU_LAYERS)
    yield eng
    eng.close()


def replay_logits(engine, prompt, tokens):
    """The raw logits before each token of ``tokens``, from an engine sampling on the CPU
    (the generated tokens decoded one at a time, as the generation did)."""
    return [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.ctx, -1),
                                  shape=(engine.n_vocab,)).copy()
            for _ in engine.replay(engine.prompt_tokens(prompt), tokens)]


@pytest.mark.parametrize("spec,eps,uniform", [("adaptive:eps=0.0005", 0.0005, False),
                                              ("adaptive:eps=0.002,temp=1.3", 0.002, False),
                                              ("adaptive:eps=0.001,mode=uniform", 0.001, True)])
def test_in_graph_k_and_tokens_match_the_reference_on_real_logits(graph_engine, engine, spec,
                                                                  eps, uniform):
    prompt = "The history of the river Thames begins"
    result = graph_engine.generate(prompt, sampler=spec, max_tokens=40, seed=5)
    assert graph_engine.backend_sampling and result.backend == "graph"
    assert len(result.token_stats) == len(result.tokens) >= 20
    temp = 1.3 if "temp" in spec else 1.0
    for x, token, stats in zip(replay_logits(engine, prompt, result.tokens), result.tokens,
                               result.token_stats):
        x = (x / np.float32(temp)).astype(np.float32)  # what the graph's temp sampler leaves
        k = reference_k(x, eps)
        assert stats.k == k or near_boundary(x, eps)
        assert token in np.argsort(-x, kind="stable")[:stats.k]  # sampled inside the kept set
        if not uniform:
            p = np.exp(x.astype(np.float64) - x.max())
            p /= p.sum()
            assert stats.kept_mass == pytest.approx(np.sort(p)[::-1][:stats.k].sum(), rel=1e-4)
            assert stats.p_chosen == pytest.approx(p[token], rel=1e-4)
        else:
            assert np.isnan(stats.kept_mass)


def test_in_graph_seeds_repeat_and_greedy_is_the_cpu_chains(graph_engine, engine):
    prompt = "Once upon a time"
    first, again, other = (graph_engine.generate(prompt, sampler="adaptive", max_tokens=24,
                                                 seed=s).text for s in (7, 7, 8))
    assert first == again and first != other
    greedy = graph_engine.generate(prompt, sampler="greedy", max_tokens=24).text
    assert greedy == engine.generate(prompt, sampler="greedy", max_tokens=24).text


def test_in_graph_sequences_run_side_by_side(graph_engine):
    results = graph_engine.generate_batch(
        ["Once upon a time", "The capital of France", "In 1905, Einstein"],
        sampler=["adaptive", "top-p:p=0.9", "min-p:p=0.1,temp=0.8"], max_tokens=16)
    assert all(r.completion_tokens > 0 and r.backend == "graph" for r in results)
    assert results[0].token_stats and not results[1].token_stats


def test_dist_runs_in_the_graph_as_on_the_cpu_at_a_low_temperature(graph_engine, engine):
    # temp 0.01 sharpens every step to its arg-max: both paths then give greedy's text.
    prompt = "The capital of France is"
    graph = graph_engine.generate(prompt, sampler="dist:temp=0.01", max_tokens=12, seed=3)
    cpu = engine.generate(prompt, sampler="dist:temp=0.01", max_tokens=12, seed=3)
    assert graph.backend == "graph" and graph.text == cpu.text
    assert graph_engine.generate(prompt, sampler="dist", max_tokens=12, seed=4).text != \
        graph_engine.generate(prompt, sampler="dist", max_tokens=12, seed=5).text


def test_truncations_cut_before_the_last_one_in_the_graph_too(graph_engine):
    prompt = "The old lighthouse keeper"
    greedy = graph_engine.generate(prompt, sampler="greedy", max_tokens=12).text
    cut = graph_engine.generate(prompt, sampler="top-k:k=1+top-p:p=0.99,temp=3",
                                max_tokens=12, seed=2)
    assert cut.backend == "graph" and cut.text == greedy


@pytest.mark.parametrize("spec,named", [
    ("eta", "`eta`"), ("typical:p=0.9", "`typical`"), ("mirostat", "`mirostat`"),
    ("typical:p=0.5+top-p:p=0.9", "`typical`"),
    ("adaptive+penalties+xtc", "`penalties`, `xtc`"), ("greedy+dry", "`dry`")])
def test_samplers_without_a_graph_path_are_refused_in_one_line(graph_engine, spec, named):
    with pytest.raises(SpecError, match=f"^{named} cannot run inside llama.cpp's graph.*"
                       "greedy, top-k"):
        graph_engine.generate("Hi", sampler=spec, max_tokens=4)
    assert graph_engine.generate("Hi", sampler="adaptive", max_tokens=4).completion_tokens


def test_logprobs_and_grammars_are_refused_with_backend_sampling(graph_engine):
    with pytest.raises(ValueError, match="`logprobs` needs the model's logits"):
        graph_engine.generate("Hi", logprobs=2, max_tokens=4)
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
    with pytest.raises(SpecError, match="a grammar cannot run inside"):
        graph_engine.generate("Hi", grammar=grammar, max_tokens=4)


def test_backend_sampling_has_to_be_a_bool(smollm2_path):
    with pytest.raises(ValueError, match="`backend_sampling` has to be True or False"):
        Engine(smollm2_path, backend_sampling="yes")


# ---- the command line, the REPL and the servers ----

def test_generate_with_backend_sampling_reports_the_graph_backend():
    out = run_cli("generate", "smollm2", "--prompt", "Once upon a time", "--max-tokens", "12",
                  "--backend-sampling", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["backend"] == "graph" and figures["mean_k"] >= 1
    assert figures["completion_tokens"] >= 1


def test_a_sampler_without_a_graph_path_is_one_line_at_start():
    out = run_cli("generate", "smollm2", "--prompt", "Hi", "--backend-sampling",
                  "--sampler", "mirostat")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "Error: --sampler: `mirostat` cannot run inside llama.cpp's graph (backend sampling): "
        "use greedy, top-k, top-p, min-p, adaptive, dist, or turn backend sampling off"]


def test_config_file_turns_backend_sampling_on_and_rejects_a_non_boolean():
    path = config.config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[models.smollm2]\nbackend_sampling = true\n")
    out = run_cli("generate", "smollm2", "--prompt", "Hi", "--max-tokens", "4", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["backend"] == "graph", out.stderr
    path.write_text("[defaults]\nbackend_sampling = \"yes\"\n")
    out = run_cli("generate", "smollm2", "--prompt", "Hi")
    assert out.returncode == 2 and "backend_sampling" in out.stderr
    assert "has to be true or false" in out.stderr


def test_repl_refuses_a_sampler_without_a_graph_path_and_keeps_the_old_one():
    result = CliRunner().invoke(main, ["run", "--max-tokens", "8", "--backend-sampling"],
                                input="/set sampler eta\nHi\n/compare typical\n/show\n")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "`eta` cannot run inside llama.cpp's graph" in result.output
    assert "kept the old value" in result.output
    assert "`typical` cannot run inside llama.cpp's graph" in result.output
    assert re.search(r"sampler +adaptive:eps=0.005,", result.output)
    assert re.search(r"backend +graph", result.output)


@pytest.fixture(scope="module")
def graph_server(smollm2_path, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("graph-server") / "server.log"
    yield from serving(smollm2_path, log_file, "--parallel", "2", "--backend-sampling")


def test_server_with_backend_sampling_answers_and_refuses_in_400s(graph_server):
    chat = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 8}
    status, _, body = raw("POST", graph_server, "/v1/chat/completions", chat)
    assert status == 200 and body["sampler_stats"]["backend"] == "graph"
    status, _, body = raw("POST", graph_server, "/v1/chat/completions",
                          {**chat, "sampler": "eta"})
    assert status == 400 and "cannot run inside llama.cpp's graph" in body["error"]["message"]
    status, _, body = raw("POST", graph_server, "/v1/chat/completions",
                          {**chat, "logprobs": True})
    assert status == 400 and "`logprobs` needs the model's logits" in body["error"]["message"]
    status, _, body = raw("POST", graph_server, "/api/chat",
                          {"model": "smollm2", "messages": chat["messages"], "stream": False,
                           "options": {"sampler": "typical:p=0.9"}})
    assert status == 400 and "cannot run inside" in body["error"]
    status, _, body = raw("POST", graph_server, "/api/chat",
                          {"model": "smollm2", "messages": chat["messages"], "stream": False,
                           "options": {"num_predict": 6, "min_p": 0.1}})
    assert status == 200 and body["done"] and body["message"]["content"]


def test_the_support_probe_runs_against_a_real_device():
    # llama.cpp hands the sampler no device on the CPU, so without a GPU it never calls the
    # probe; ask llama.cpp's CPU device, which runs every operation, through the same ctypes
    # functions a GPU run uses (a misnamed one once failed only on CUDA).
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    cpu = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    assert cpu
    for epsilon, uniform in ((0.0005, False), (0.01, True)):
        assert graph.unsupported_op(cpu, epsilon, uniform) is None


def _missing_top_k(device, epsilon, uniform):
    return "TOP_K"


def _probe_breaks(device, epsilon, uniform):
    raise RuntimeError("probe broke")


@pytest.mark.parametrize("probe,reason", [
    (_missing_top_k, "FakeGPU cannot run the TOP_K operation that the adaptive sampler needs"),
    (_probe_breaks, "the adaptive sampler's support check failed (the error is logged)")])
def test_a_device_without_an_operation_falls_back_to_the_cpu_with_one_warning(
        smollm2_path, monkeypatch, caplog, probe, reason):
    # A device (on the CPU, llama.cpp hands the sampler no device) that lacks one operation,
    # or whose probe raises: either way the CPU chain runs, never a half-built graph chain.
    api = ggml.lib
    monkeypatch.setattr(api, "backend_buft_get_device", lambda buft: 1)
    monkeypatch.setattr(api, "backend_dev_name", lambda device: b"FakeGPU")
    monkeypatch.setattr(graph, "unsupported_op", probe)
    with caplog.at_level("WARNING"):
        eng = Engine(smollm2_path, n_ctx=256, backend_sampling=True)
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warnings == [f"backend sampling is off: {reason}; sampling on the CPU instead"]
        assert not eng.backend_sampling
        result = eng.generate("Once upon a time", max_tokens=6, logprobs=1)
        assert result.backend in ("c", "numba") and len(result.logprobs) == 6
    finally:
        eng.close()


# ---- what the graph adds per sequence, and its self-check ----

def test_the_sampler_adds_31_operations_per_sequence_and_30_in_uniform_mode():
    ops = graph.graph_ops(0.005, uniform=False)
    assert len(ops) == 31 and len(graph.graph_ops(0.005, uniform=True)) == 30
    # one top-k over V and a sort of the K candidates only; no constant built in the graph
    assert ops.count("TOP_K") == 1 and ops.count("ARGSORT") == 1
    assert "ARANGE" not in ops and "CONT" not in ops


def test_constants_are_the_formulas_terms_in_float64():
    V, eps = 262_144, 0.005
    K = graph.n_candidates(V, eps)
    ln_n, spread, threshold = graph.constants(V, K, eps).reshape(3, K).astype(np.float64)
    n = np.arange(V - K, V, dtype=np.float64)
    np.testing.assert_allclose(ln_n, np.log(n), rtol=1e-7)
    # ln((n+1)/n) is about 1/n: float32 could not form the ratio, float64 does
    np.testing.assert_allclose(spread, np.log((n + 1) / n), rtol=1e-6)
    assert np.all(threshold[:-1] == np.float32(-eps * np.log(V)))
    assert threshold[-1] == np.float32(1e30)
    # a vocabulary of K: n reaches 0, where the limit takes over (clamped to 1, ln 1 = 0)
    ln_n, spread, _ = graph.constants(5, 5, 0.25).reshape(3, 5)
    assert ln_n[0] == 0 and spread[0] == 0 and spread[1] == pytest.approx(np.log(2))


@pytest.mark.parametrize("gap,k,expected", [(1e-5, 3, True), (1e-5, 2, True), (1e-5, 4, False),
                                            (2e-4, 2, False), (1e-2, 2, False)])
def test_verdict_accepts_a_difference_only_within_tolerance_of_epsilon(gap, k, expected):
    # Four tokens and a tail; epsilon just below dConf_3 (relative gap), so the reference's
    # k* is 3. Stopping at 2 is a rounding of dConf_3 only if it lies within 1e-4 of
    # epsilon; going to 4 claims dConf_4 > epsilon, far off.
    p = np.array([0.5, 0.3, 0.1, 0.01])
    tail, V = 0.09, 1000
    d = dconf_of_head(p, tail, V)
    assert d[3] < d[2] / 2
    verdict = graph.verdict(p, tail, V, d[2] * (1 - gap), k)
    assert verdict["k_ref"] == 3 and verdict["equal"] == (k == 3)
    assert verdict["within_tolerance"] == expected
    assert verdict["mass_error"] == pytest.approx(0.0, abs=1e-15)


def test_self_check_of_a_generation_on_the_cpu_backend_matches_float64(graph_engine):
    with graph.self_check() as records:
        graph_engine.generate("The history of the river Thames begins", sampler="adaptive",
                              max_tokens=24, seed=2)
        graph_engine.generate_batch(["Once upon a time", "In 1905, Einstein"],
                                    sampler="adaptive:eps=0.0005,temp=1.3", max_tokens=12)
    assert len(records) == 24 + 2 * 12
    assert all(r["equal"] for r in records), [r for r in records if not r["equal"]][:3]
    assert max(r["mass_error"] for r in records) < 1e-5
    assert all(r["k"] >= 1 for r in records) and len({r["k"] for r in records}) > 3
    # outside the block nothing is recorded
    graph_engine.generate("Once upon a time", sampler="adaptive", max_tokens=4)
    assert len(records) == 48


def test_the_temperature_is_the_softmaxs_scale_in_the_graph_not_a_sampler_of_its_own():
    from adaptive_llama.llama.chain import SamplerChain

    with SamplerChain("adaptive:temp=0.7", 0, 1000, in_graph=True) as folded, \
            SamplerChain("top-p:p=0.9,temp=0.7", 0, 1000, in_graph=True) as other:
        assert "temp" not in folded.names() and "temp" in other.names()
    x = np.random.default_rng(4).normal(0, 3, 5000).astype(np.float32)
    out, ids = graph.evaluate(x, 0.005, temp=0.7)
    k = int(np.isfinite(out).sum())
    assert k == reference_k(x / np.float32(0.7), 0.005) or near_boundary(x / 0.7, 0.005)
    p = np.exp(x.astype(np.float64) / 0.7 - x.max() / 0.7)
    np.testing.assert_allclose(np.exp(out[-k:]), (p / p.sum())[ids[-k:]], rtol=1e-5)
