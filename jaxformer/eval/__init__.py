"""jaxformer under lm-evaluation-harness (the optional extra `jaxformer[eval]`).

    python -m jaxformer.eval RUN_DIR|HF_DIR --tasks T1,T2 [--include_path DIR] [--limit N]
        [--batch_size B] [--output results.json]

`JaxformerLM` (jaxformer.eval.lm) is lm-eval's model API for a run dir or an HF folder;
it is imported on first use, so this package imports without lm-eval. `load_model`
(jaxformer.eval.loading) and `Scorer` (jaxformer.eval.scoring) need only jaxformer.
"""

from jaxformer.eval.loading import Loaded, load_model
from jaxformer.eval.scoring import Scorer

__all__ = ["JaxformerLM", "Loaded", "Scorer", "load_model"]


def __getattr__(name):
    if name == "JaxformerLM":
        from jaxformer.eval.lm import JaxformerLM
        return JaxformerLM
    raise AttributeError(f"module 'jaxformer.eval' has no attribute {name!r}")
