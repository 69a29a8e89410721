"""Embeddings: the engine's embedder with the bundled model, and /v1/embeddings, /api/embed
and /api/embeddings on `adaptive-llama serve` through the openai and ollama clients."""

import base64

import numpy as np
import ollama
import openai
import pytest
from test_cli import assert_one_line_error, run_cli
from test_server import API_KEY, raw, server, server_log  # noqa: F401 (fixtures)

from adaptive_llama.runtime import embeddings
from adaptive_llama.runtime.embeddings import Embedder
from adaptive_llama.runtime.request import InvalidArgument

CATS = ["The cat sat on the mat.", "A cat is sitting on a rug.",
        "Quarterly revenue rose by four percent."]


def vectors(embedder, texts):
    return embedder.embed([embedder.tokenize(t) for t in texts])


def test_vectors_are_unit_length_and_similar_texts_are_closer(engine):
    v = vectors(engine.embedder(), CATS)
    assert v.shape == (3, engine.embedder().n_embd) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    cos = v @ v.T
    assert cos[0, 1] > cos[0, 2] and cos[0, 1] > cos[1, 2]  # cats before revenue


def test_texts_decoded_together_get_the_vectors_they_get_alone(engine, monkeypatch):
    embedder = engine.embedder()
    together = vectors(embedder, CATS)
    alone = np.stack([vectors(embedder, [t])[0] for t in CATS])
    assert np.abs(together - alone).max() < 1e-4
    # Batches split by the sequence limit (2 here: three batches... of 2 and 1).
    monkeypatch.setattr(embeddings, "MAX_SEQUENCES", 2)
    assert list(embedder._batches([[1]] * 5)) == [(0, 2), (2, 4), (4, 5)]
    assert np.abs(vectors(embedder, CATS) - together).max() < 1e-4


def test_batches_stay_within_the_token_limit(engine):
    embedder = engine.embedder()
    big = embedder.max_tokens - 1
    assert list(embedder._batches([[1] * big, [1] * 2, [1] * 5])) == [(0, 1), (1, 3)]


def test_the_mean_pools_every_token(engine):
    """A chat model names no pooling: mean. Mean pooling is order-blind only in its sum, so
    the vector of a text moves when one token changes, and a repeated text keeps it."""
    embedder = engine.embedder()
    assert embedder.pooling == 1  # LLAMA_POOLING_TYPE_MEAN
    a, b = vectors(embedder, ["red apple", "green apple"])
    assert not np.allclose(a, b)
    assert np.allclose(vectors(embedder, ["red apple"])[0], a, atol=1e-5)


@pytest.mark.parametrize("inputs,message", [
    ([[]], "`input` is empty"),
    ([[1], [10**7]], "`input.1`: 10000000 is not a token"),
    ([[1] * 5000], "`input` has 5000 tokens, but"),
])
def test_bad_inputs_are_named(engine, inputs, message):
    with pytest.raises(InvalidArgument) as info:
        engine.embedder().check(inputs)
    assert message in str(info.value)


def test_a_separate_embedding_model_gives_the_same_vectors_for_the_same_file(engine):
    other = Embedder.open(engine.path, threads=1)
    try:
        assert np.abs(vectors(other, CATS) - vectors(engine.embedder(), CATS)).max() < 1e-4
    finally:
        other.close()


def test_an_embedding_model_that_is_not_there_is_one_line_at_start(tmp_path):
    result = run_cli("serve", "smollm2", "--embedding-model", str(tmp_path / "none.gguf"),
                     "--port", "0")
    assert_one_line_error(result, "none.gguf")


# ---- the servers ----

@pytest.fixture
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


def test_openai_embeddings_in_both_encodings(client, server, engine):  # noqa: F811
    r = client.embeddings.create(model="any", input=CATS)  # the client asks for base64
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert np.abs(got - vectors(engine.embedder(), CATS)).max() < 1e-4
    tokens = sum(len(engine.embedder().tokenize(t)) for t in CATS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    status, _, body = raw("POST", server, "/v1/embeddings",
                          {"input": CATS[0], "encoding_format": "float"})
    assert status == 200 and np.allclose(body["data"][0]["embedding"], got[0], atol=1e-5)
    as_numbers = np.float32(body["data"][0]["embedding"])
    status, _, body = raw("POST", server, "/v1/embeddings",
                          {"input": CATS[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert np.array_equal(decoded, as_numbers)  # the same float32 values, bit for bit


def test_openai_embeddings_of_token_ids(client, engine):
    ids = engine.embedder().tokenize(CATS[0])
    one = client.embeddings.create(model="any", input=ids).data[0].embedding
    two = client.embeddings.create(model="any", input=[ids, ids]).data
    assert len(two) == 2 and np.allclose(one, two[1].embedding, atol=1e-6)
    assert np.allclose(one, vectors(engine.embedder(), CATS[:1])[0], atol=1e-4)


@pytest.mark.parametrize("body,needle", [
    ({"input": ""}, "`input` is empty"),
    ({"input": []}, "`input`"),
    ({"input": ["ok", ""]}, "`input.1` is empty"),
    ({"input": [1, -5]}, "`input`: -5 is not a token"),
    ({"input": "x", "dimensions": 64}, "`dimensions` is not supported"),
    ({"input": "x", "encoding_format": "int8"}, "`encoding_format`"),
    ({"input": ["x"] * 300}, "`input`"),
])
def test_bad_embedding_requests_get_a_400(server, body, needle):  # noqa: F811
    status, _, answer = raw("POST", server, "/v1/embeddings", body)
    assert status == 400 and needle in answer["error"]["message"], answer


def test_ollama_embed_and_the_older_embeddings(server, engine):  # noqa: F811
    client = ollama.Client(host=f"http://127.0.0.1:{server}",
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    r = client.embed(model="smollm2", input=CATS)
    expected = vectors(engine.embedder(), CATS)
    assert np.abs(np.array(r.embeddings) - expected).max() < 1e-4
    assert r.prompt_eval_count == sum(len(engine.embedder().tokenize(t)) for t in CATS)
    old = client.embeddings(model="smollm2", prompt=CATS[0])
    assert np.allclose(old.embedding, expected[0], atol=1e-4)
    # truncate (the default) cuts a text that is too long; without it, a 400 that says so.
    long = "word " * 3000
    assert len(client.embed(model="smollm2", input=long).embeddings[0]) == len(expected[0])
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="smollm2", input=long, truncate=False)
    assert caught.value.status_code == 400 and "tokens, but" in caught.value.error
