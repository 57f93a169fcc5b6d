"""Tests of jaxformer.convert: checkpoints and PEFT adapters out and back, the CLI."""
