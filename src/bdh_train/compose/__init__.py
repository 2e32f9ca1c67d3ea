"""New checkpoints from trained ones: `grow` (more neurons, the same function), `merge`
(sources side by side, optionally fine-tuned), and the official implementation's checkpoints
imported; `common` loads the sources and writes the result."""
