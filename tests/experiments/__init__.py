"""Tests of jaxformer.experiments: the positional-encoding studies."""
