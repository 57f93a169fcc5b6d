"""Decoding with a KV cache: the scan loop of sampling (loops), beam search (beam), the
per-row sampling settings (sampling), n-gram and length constraints (constraints), the
cached forward the loops call (cached_forward), speculative decoding (speculative) and
encoder-decoder decoding (seq2seq).

``from jaxformer.decode import generate, beam_search``"""

from jaxformer.decode.beam import beam_search
from jaxformer.decode.loops import generate, init_cache, kv_cache_bytes

__all__ = ["beam_search", "generate", "init_cache", "kv_cache_bytes"]
