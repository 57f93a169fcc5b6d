"""Tests of jaxformer.data, one file per module, against plain-Python/NumPy references."""
