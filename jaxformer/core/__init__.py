"""The bottom wing: what every other wing builds on and nothing here builds on them.
Config validation (validation), mesh and logical-axis sharding (sharding), the CPU
allocator setting (host_memory), named activation hooks (hooks), the weight matmul's
precision table (matmul), per-token log-probabilities (logprobs), and the reference
attention math that every backend is tested against (reference)."""
