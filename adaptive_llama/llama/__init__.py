"""Every contact with llama.h: the struct layouts this package mirrors and the releases they
are checked against (:mod:`.abi`), sampler chains built from specs (:mod:`.chain`), the numba
stand-ins for the C samplers (:mod:`.numba_samplers`), and adaptive decoding inside
llama.cpp's graph (:mod:`.graph`)."""

from .chain import LLAMA_CPP_VERSION, SamplerChain, use_sampler

__all__ = ["LLAMA_CPP_VERSION", "SamplerChain", "use_sampler"]
