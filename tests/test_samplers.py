"""The sampler table and spec syntax: defaults, ranges, and one-line errors that say what is
valid. Pure Python: no model, no llama.cpp."""

import math

import pytest

from adaptive_llama.samplers import (
    EPSILON,
    SAMPLERS,
    SEED,
    Param,
    SamplerSpec,
    SpecError,
    parse_spec,
    spec_from_options,
    spec_of,
    table,
    valid_specs,
)

# The numba pass of `make test` runs these again (tests/test_marks.py).
pytestmark = pytest.mark.backend


@pytest.mark.parametrize("text,name,params,temp", [
    ("greedy", "greedy", {}, 1.0),
    ("top-k:k=40", "top-k", {"k": 40}, 1.0),
    ("top-p:p=0.9,temp=0.7", "top-p", {"p": 0.9}, 0.7),
    ("typical", "typical", {"p": 0.95}, 1.0),
    ("min-p:p=0.05", "min-p", {"p": 0.05}, 1.0),
    ("mirostat:tau=5,eta=0.1", "mirostat", {"tau": 5.0, "eta": 0.1}, 1.0),
    ("mirostat1", "mirostat1", {"tau": 5.0, "eta": 0.1, "m": 100}, 1.0),
    ("eta:eps=0.0009", "eta", {"eps": 0.0009}, 1.0),
    ("adaptive:eps=0.001,mode=uniform", "adaptive", {"eps": 0.001, "mode": "uniform"}, 1.0),
    (" ADAPTIVE ", "adaptive", {"eps": 0.005, "mode": "multinomial"}, 1.0),
    ("top-k:k=1e3", "top-k", {"k": 1000}, 1.0),   # an integer written as a float is fine
    ("adaptive:eps=1e-300", "adaptive", {"eps": 1e-300, "mode": "multinomial"}, 1.0),
    ("mirostat:tau=1000001", "mirostat", {"tau": 1000001.0, "eta": 0.1}, 1.0),  # was 1e+06
])
def test_parse(text, name, params, temp):
    spec = parse_spec(text)
    assert (spec.name, spec.params, spec.temp) == (name, params, temp)
    assert parse_spec(str(spec)) == spec  # str round-trips


@pytest.mark.parametrize("text,message", [
    ("nucleus", "unknown sampler 'nucleus'; valid: greedy, top-k:k=40"),
    ("top-p:p=2", "`p` has to be in (0, 1], but is 2"),
    ("top-k:k=0", "`k` has to be an integer in [1, 2147483647], but is 0"),
    ("top-k:k=2.5", "`k` has to be an integer, but is 2.5"),
    ("top-k:k=1e400", "`k` has to be an integer, but is 1e400"),        # was a traceback
    ("top-k:k=99999999999", "`k` has to be an integer in [1, 2147483647]"),
    ("mirostat1:m=-1", "`m` has to be an integer in [1, 2147483647], but is -1"),
    ("adaptive:eps=1", "`eps` has to be in (0, 1), but is 1"),
    ("adaptive:eps=0", "`eps` has to be in (0, 1), but is 0"),
    ("adaptive:eps=-1e-20", "`eps` has to be in (0, 1)"),
    ("adaptive:eps=abc", "`eps` has to be a finite number, but is 'abc'"),
    ("adaptive:eps=inf", "`eps` has to be a finite number, but is inf"),
    ("adaptive:mode=random", "`mode` has to be multinomial or uniform, but is random"),
    ("adaptive:epsilon=0.1", "adaptive takes eps=, mode=, temp=, not 'epsilon=0.1'"),
    ("adaptive:eps=0.001,eps=0.002", "`eps` is given twice"),
    ("adaptive:eps", "adaptive takes eps=, mode=, temp=, not 'eps'"),
    ("greedy:temp=0.5", "greedy takes no parameters, not 'temp=0.5'"),
    ("top-p:temp=0", "`temp` has to be in [1e-06, 1e+06], but is 0"),
    ("top-p:temp=1e-9", "`temp` has to be in [1e-06, 1e+06]"),
    ("min-p:p=nan", "`p` has to be a finite number, but is nan"),
    ("mirostat:tau=0", "`tau` has to be in (0, inf), but is 0"),
])
def test_errors(text, message):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_only_text_is_parsed():
    with pytest.raises(SpecError, match="has to be text"):
        parse_spec(0.5)
    spec = parse_spec("adaptive")
    assert spec_of(spec) is spec and spec_of("adaptive") == spec


def test_with_param_validates_and_keeps_the_rest():
    spec = parse_spec("adaptive:eps=0.001,temp=0.8")
    assert spec.with_param("eps", "0.002").params["eps"] == 0.002
    assert spec.with_param("eps", "0.002").temp == 0.8
    assert spec.with_param("temp", 0.5) == parse_spec("adaptive:eps=0.001,temp=0.5")
    with pytest.raises(SpecError, match="`eps` has to be in"):
        spec.with_param("eps", "2")
    with pytest.raises(SpecError, match="top-k has no `eps`"):
        parse_spec("top-k").with_param("eps", 0.1)


def test_every_entry_documents_and_accepts_its_own_defaults():
    for name, sampler in SAMPLERS.items():
        spec = parse_spec(f"dist+{name}" if sampler.is_modifier else name)
        default = spec.modifiers[0] if sampler.is_modifier else spec
        assert isinstance(default, SamplerSpec) and default.name == name
        for param in sampler.params:
            assert default.params[param.name] == param.default
            assert param.validate(param.default) == param.default
            assert param.help and param.range_text()
        assert name in valid_specs() and sampler.summary in table()


def test_epsilon_is_one_parameter_for_specs_and_kernel():
    from adaptive_llama.kernel import validate_epsilon

    for bad in (0, 1, -0.5, math.nan, math.inf, "x", None):
        with pytest.raises(ValueError):
            validate_epsilon(bad)
        with pytest.raises(SpecError):
            EPSILON.validate(bad)
    with pytest.raises(ValueError, match="`epsilon` has to be in"):
        validate_epsilon(2)
    assert validate_epsilon("0.001") == 0.001 == parse_spec("adaptive:eps=0.001").params["eps"]


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70, 1.5, "x", math.inf])
def test_seeds_outside_uint32_are_refused_not_wrapped(seed):
    with pytest.raises(SpecError, match="`seed`"):
        SEED.validate(seed)
    assert SEED.validate(2**32 - 1) == 2**32 - 1


@pytest.mark.parametrize("text,accepted", [
    # min-p's p lies in the closed [0, 1]: both ends are valid, just outside is not.
    ("min-p:p=0", True), ("min-p:p=1", True), ("min-p:p=-1e-9", False),
    ("min-p:p=1.000001", False),
    # top-p's p lies in (0, 1]: 0 is not valid, 1 is.
    ("top-p:p=0", False), ("top-p:p=1e-300", True), ("top-p:p=1", True),
    # temp lies in [1e-6, 1e6].
    ("top-k:temp=1e-6", True), ("top-k:temp=1e6", True), ("top-k:temp=1000000.5", False),
    ("top-k:k=1", True), ("top-k:k=2147483647", True), ("top-k:k=2147483648", False),
])
def test_each_bound_is_open_or_closed_as_its_range_says(text, accepted):
    if accepted:
        parse_spec(text)
    else:
        with pytest.raises(SpecError):
            parse_spec(text)


def test_range_text_writes_the_interval_with_its_brackets():
    assert EPSILON.range_text() == "in (0, 1)"
    assert SAMPLERS["min-p"].params[0].range_text() == "in [0, 1]"
    assert SAMPLERS["mirostat"].params[0].range_text() == "in (0, inf)"
    assert SAMPLERS["top-k"].params[0].range_text() == "an integer in [1, 2147483647]"
    assert Param("x", float, 0.0, "h", high=2.0).range_text() == "in (-inf, 2]"
    assert Param("n", int, 3, "h").range_text() == "an integer in (-inf, inf)"


def test_spec_text_shows_temp_only_when_it_is_not_one_and_reads_back():
    assert str(parse_spec("top-k:k=40")) == "top-k:k=40"
    assert str(parse_spec("top-k:k=40,temp=5")) == "top-k:k=40,temp=5"  # 5.0 written as 5
    assert str(parse_spec("top-p:temp=0.25")) == "top-p:p=0.95,temp=0.25"
    assert str(parse_spec("greedy")) == "greedy"
    assert str(SamplerSpec("greedy", {}, 2.0)) == "greedy"  # greedy takes no temperature
    for name in (n for n, s in SAMPLERS.items() if not s.is_modifier):
        for spec in (parse_spec(name), parse_spec(name).with_param("temp", 1.5)
                     if SAMPLERS[name].takes_temp else parse_spec(name)):
            assert parse_spec(str(spec)) == spec


def test_with_param_names_what_the_sampler_takes():
    spec = parse_spec("top-k:k=5")
    changed = spec.with_param("k", 7)
    assert (changed.name, changed.params, changed.temp) == ("top-k", {"k": 7}, 1.0)
    with pytest.raises(SpecError) as info:
        spec.with_param("p", 0.5)
    assert str(info.value) == "top-k has no `p`; it takes k=, temp="
    with pytest.raises(SpecError) as info:
        parse_spec("greedy").with_param("temp", 0.5)
    assert str(info.value) == "greedy has no `temp`; it takes no parameters"


def test_a_value_holding_an_equals_sign_is_a_bad_value():
    with pytest.raises(SpecError, match=r"`p` has to be a finite number, but is '0.5=0.6'"):
        parse_spec("top-p:p=0.5=0.6")


def test_the_listings_show_every_sampler_with_its_defaults():
    specs = valid_specs()
    assert specs.startswith("greedy, top-k:k=40, top-p:p=0.95, ")
    assert "adaptive:eps=0.005,mode=multinomial" in specs
    assert "(all but greedy also take temp=1); modifiers, joined with +: penalties:" in specs
    assert specs.endswith("xtc:probability=0.5,threshold=0.1")
    lines = table().splitlines()
    assert lines[0].startswith("Samplers (one per spec; truncations may join each other")
    assert "the last in the order top-k, typical, top-p, min-p sampling" in lines[0]
    assert lines[1].startswith("  greedy       argmax")
    eps_line = next(line for line in lines if line.lstrip().startswith("eps=0.005"))
    assert eps_line == " " * 16 + f"{'eps=0.005':<22} in (0, 1): threshold epsilon"
    modifiers = lines.index(next(line for line in lines if line.startswith("Modifiers")))
    assert "order: penalties, dry, top-n-sigma, temp, the sampler, xtc" in lines[modifiers]
    assert lines[modifiers + 1].startswith("  penalties    ")


ADAPTIVE_HOT = parse_spec("adaptive:eps=0.001,temp=0.8")


@pytest.mark.parametrize("options,expected", [
    ({}, "adaptive:eps=0.001,temp=0.8"),
    # sampler text wins over the truncation options, which then do nothing
    (dict(sampler="eta", top_p=0.5), "eta:eps=0.0009"),
    # every truncation option that truncates, in llama.cpp's order: the last samples at
    # the default's temperature, the others cut before it
    (dict(min_p=0.1, top_p=0.5, top_k=5), "top-k:k=5+top-p:p=0.5+min-p:p=0.1,temp=0.8"),
    (dict(min_p=0.0, top_p=0.5, top_k=5), "top-k:k=5+top-p:p=0.5,temp=0.8"),
    (dict(top_p=1.0, top_k=5), "top-k:k=5,temp=0.8"),
    (dict(top_p=1.0, top_k=0, typical_p=1.0), "adaptive:eps=0.001,temp=0.8"),
    (dict(typical_p=0.5, top_p=0.9), "typical:p=0.5+top-p:p=0.9,temp=0.8"),
    (dict(typical_p=0.5), "typical:p=0.5,temp=0.8"),
    # temperature 0 and mirostat choose alone, as in llama.cpp: the cuts go
    (dict(top_k=5, top_p=0.5, temperature=0), "greedy"),
    (dict(top_k=5, mirostat=2), "mirostat:temp=0.8"),
    # temperature on top; 0 is greedy; a sampler without one ignores it
    (dict(temperature=1.5), "adaptive:eps=0.001,temp=1.5"),
    (dict(temperature=0, sampler="top-k:k=3"), "greedy"),
    (dict(sampler="greedy", temperature=0.7), "greedy"),
    # epsilon on the spec that has one
    (dict(epsilon=0.02), "adaptive:eps=0.02,temp=0.8"),
    (dict(sampler="eta", epsilon=0.002), "eta:eps=0.002"),
])
def test_client_options_become_one_spec(options, expected):
    assert spec_from_options(ADAPTIVE_HOT, **options) == parse_spec(expected)


@pytest.mark.parametrize("text, sampler, cuts", [
    ("top-k:k=40+top-p:p=0.95+min-p:p=0.05", "min-p", ["top-k", "top-p"]),
    ("min-p:p=0.05+top-p:p=0.95+top-k:k=40", "min-p", ["top-k", "top-p"]),  # any order
    ("top-p:p=0.9,temp=0.7+typical:p=0.5+penalties", "top-p", ["typical"]),
    ("top-p:p=0.9+top-k:k=5", "top-p", ["top-k"]),
])
def test_truncations_join_as_cuts_before_the_last_in_llama_cpps_order(text, sampler, cuts):
    spec = parse_spec(text)
    assert spec.name == sampler and [c.name for c in spec.stage("cut")] == cuts
    assert parse_spec(str(spec)) == spec  # written back as it reads
    assert all(m.sampler.is_modifier for m in spec.stage("before"))


@pytest.mark.parametrize("text, message", [
    ("top-k:k=4,temp=0.5+min-p", "top-k cuts before min-p, which takes the temperature"),
    ("top-k+adaptive", r"a spec has one sampler, but 'top-k\+adaptive' has top-k and adaptive"),
    ("top-k+top-k:k=3", "`top-k` is given twice"),
    ("min-p+eta", "has min-p and eta"),
])
def test_only_truncations_join_each_other(text, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(text)


@pytest.mark.parametrize("options,message", [
    (dict(sampler="top-k", epsilon=0.01), "`epsilon` applies to adaptive and eta, not to top-k"),
    (dict(epsilon=2.0), "`epsilon` has to be in \\(0, 1\\), but is 2"),
    (dict(top_p=0.0), "`top_p` has to be in \\(0, 1\\], but is 0"),
    (dict(sampler="nope"), "unknown sampler 'nope'"),
])
def test_client_options_out_of_range_are_spec_errors(options, message):
    with pytest.raises(SpecError, match=message):
        spec_from_options(ADAPTIVE_HOT, **options)


@pytest.mark.parametrize("option,value", [
    ("temperature", 1e-9), ("temperature", 1e7), ("top_k", 2**63), ("top_p", -0.5),
    ("min_p", 1.5), ("epsilon", 0.0), ("mirostat_tau", -1.0), ("mirostat_eta", -1.0),
    ("repeat_penalty", -1.0), ("dry_multiplier", -1.0), ("xtc_probability", 2.0),
])
def test_an_option_out_of_range_is_an_error_naming_that_option(option, value):
    # A client sent `option`: the 400 has to name it, not the spec it became.
    extra = {"mirostat": 2} if option.startswith("mirostat_") else {}
    with pytest.raises(SpecError, match=f"`{option}`") as caught:
        spec_from_options(ADAPTIVE_HOT, **{option: value}, **extra)
    assert caught.value.param == option
