"""Models: ModelConfig and its sections (config), the layer, block, norm and remat tables
(kinds), per-layer patterns (layer_pattern) and stacked runs of alike layers
(layer_runs), the Flax modules (self_attention, cross_attention, latent_attention, norms,
blocks, transformer for decoders and encoders, encoder_decoder), the module per
model.arch (archs, build), released configurations (presets), and transforms of a
params pytree (lora, quantize, inspect)."""
