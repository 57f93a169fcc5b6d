"""Serving: a continuous-batching engine over a paged KV cache (jaxformer.serve.engine)."""

from jaxformer.serve.engine import Engine, Event, RequestSettings  # noqa: F401
