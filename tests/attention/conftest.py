"""The attention tests' fixtures: blocks and chunks that short inputs span several of."""

import pytest

from jaxformer.attention import chunked


@pytest.fixture(autouse=True)
def small_blocks(rng, monkeypatch):
    """Blockwise attention in blocks of a few rows and keys, so that these small inputs
    span several blocks (padding, skipping and the online softmax's rescaling)."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", int(rng.integers(2, 9)))
    monkeypatch.setattr(blockwise, "BLOCK_K", int(rng.integers(2, 9)))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Causal blocks of 3 query rows, so the chunked backend's block edges fall inside the
    short test sequences (8 keys: blocks of 3, 3 and 2)."""
    monkeypatch.setattr(chunked, "CHUNK", 3)
