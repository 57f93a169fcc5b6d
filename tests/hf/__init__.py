"""Tests of jaxformer.hf: the model-type rows and config.json read as transformers reads it."""
