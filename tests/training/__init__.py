"""Tests of jaxformer.training: run config, loop, checkpoints, init_from."""
