"""Tests of jaxformer's attention: masks, the reference, the backends and their kernels."""
