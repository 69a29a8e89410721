"""Sampler spec syntax: defaults, values, and one-line errors that list what is valid."""

import pytest

from adaptive_llama.specs import SpecError, parse_spec


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
    (" ADAPTIVE ", "adaptive", {"eps": 0.0005, "mode": "multinomial"}, 1.0),
])
def test_parse(text, name, params, temp):
    spec = parse_spec(text)
    assert (spec.name, spec.params, spec.temp) == (name, params, temp)
    assert parse_spec(str(spec)) == spec  # str round-trips


@pytest.mark.parametrize("text,message", [
    ("nucleus", "unknown sampler 'nucleus'; valid: greedy, top-k:k=40"),
    ("top-p:p=2", "`p` has to be in (0, 1], but is 2"),
    ("top-k:k=0", "`k` has to be an integer >= 1, but is 0"),
    ("top-k:k=2.5", "`k` of top-k has to be an integer"),
    ("adaptive:eps=1", "`eps` has to be in (0, 1), but is 1"),
    ("adaptive:eps=abc", "`eps` of adaptive has to be a finite number, but is 'abc'"),
    ("adaptive:mode=random", "`mode` has to be multinomial or uniform"),
    ("adaptive:epsilon=0.1", "adaptive takes eps=, mode=, temp=, not 'epsilon=0.1'"),
    ("top-p:temp=0", "`temp` has to be a finite number > 0, but is 0"),
    ("min-p:p=nan", "has to be a finite number"),
])
def test_errors(text, message):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_with_param_validates_and_keeps_the_rest():
    spec = parse_spec("adaptive:eps=0.001,temp=0.8")
    assert spec.with_param("eps", "0.002").params["eps"] == 0.002
    assert spec.with_param("eps", "0.002").temp == 0.8
    with pytest.raises(SpecError):
        spec.with_param("eps", "2")
