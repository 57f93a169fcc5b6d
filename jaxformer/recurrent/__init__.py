"""The recurrent mixers' math, as functions of arrays: each a step-by-step recurrence (the
definition) and a chunked parallel form that trains in work and memory linear in T, with
packed segments restarting the state. conv: the short causal depthwise convolution the
mixers share (and LFM2's gated short convolution); gated_delta: the gated delta rule
(Gated DeltaNet: Qwen3-Next, Qwen3.5); ssd: Mamba-2's state space duality. The Flax
modules that declare their parameters live in jaxformer.model.mixers."""
