"""What a Hugging Face folder's generation_config.json asks of decoding, as
jaxformer.decode.constraints.Constraints: BART's summarisers, for one, decode with
no_repeat_ngram_size 3, a forced BOS and EOS and a minimum length.

    constraints = generation_constraints("path/to/hf_model", cfg)
    seq2seq_beam_search(model, params, source, ..., constraints=constraints)

Sampling and beam settings (num_beams, length_penalty, temperature) stay the caller's.
"""

from __future__ import annotations

from jaxformer.decode.constraints import Constraints
from jaxformer.hf.folder import json_object, model_folder
from jaxformer.model.archs import ARCHS
from jaxformer.model.config import ModelConfig


def _one_id(value, name: str, file) -> int | None:
    """A token id given as an int or a list of one (transformers allows both)."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{file}: {name}={value} names {len(value)} tokens; jaxformer "
                             "forces one (pass Constraints yourself)")
        value = value[0]
    return None if value is None else int(value)


def generation_constraints(path, cfg: ModelConfig) -> Constraints:
    """The Constraints of the folder's generation_config.json (none without one).
    min_length counts the decoder's whole input: for an encoder-decoder its start token
    (min_length - 1 new tokens); for a decoder-only model the prompt as well, which
    decoding here does not count, so such a min_length is refused in one line (give
    min_new_tokens)."""
    file = model_folder(path) / "generation_config.json"
    if not file.is_file():
        return Constraints()
    g = json_object(file)
    min_new = int(g.get("min_new_tokens") or 0)
    if not min_new and (g.get("min_length") or 0) > 0:
        if not ARCHS[cfg.arch].cross_attention:
            raise ValueError(f"{file}: min_length={g['min_length']} counts the prompt; "
                             "give min_new_tokens in its place (Constraints.min_new_tokens)")
        min_new = max(int(g["min_length"]) - 1, 0)
    return Constraints(min_new, int(g.get("no_repeat_ngram_size") or 0),
                       _one_id(g.get("forced_bos_token_id"), "forced_bos_token_id", file),
                       _one_id(g.get("forced_eos_token_id"), "forced_eos_token_id", file))
