"""DataConfig (jaxformer.data.config): validation against the errors it should name."""

import pytest

from jaxformer.data import DataConfig
from jaxformer.model.config import ConfigError

# ---- DataConfig ---------------------------------------------------------------------------

def test_data_config_validation():
    cfg = DataConfig.from_dict({"path": "x.txt", "tokenizer": "bpe", "pack": True})
    assert cfg.path == "x.txt" and cfg.pack and cfg.replace(pack=False).pack is False
    with pytest.raises(ConfigError, match="unknown data field.*shuffle.*valid fields are: path"):
        DataConfig.from_dict({"shuffle": True})
    with pytest.raises(ConfigError, match="data.tokenizer='byts' is not one of bytes, bpe"):
        DataConfig(tokenizer="byts")
    with pytest.raises(ConfigError, match="data.bin_dtype='int8' is not one of uint16, uint32"):
        DataConfig(bin_dtype="int8")
    with pytest.raises(ConfigError, match="data.val_fraction=1.0 must be < 1"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ConfigError, match="data.bpe_vocab_size=100 must be >= 257"):
        DataConfig(bpe_vocab_size=100)
    with pytest.raises(ConfigError, match="data.pack=1 must be true or false"):
        DataConfig(pack=1)
