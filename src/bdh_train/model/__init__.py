"""The BDH model: config, module, state, executors, positions, heads, quantizers."""
