"""Mixture of experts: the config, routers and dispatches as tables (experts), the grouped
matmuls the dropless dispatch runs on (grouped_matmul, grouped_vmap), expert parallelism
over the mesh's `expert` axis (expert_parallel) and the auxiliary-loss-free balancing
that training applies between steps (balancing). The Flax module is
jaxformer.model.blocks.MoEFeedForward."""
