"""Generating from a trained run: a sequence continued across calls with its state
(`Continuation`, saved and loaded as a state file), chat, and prompt files completed in
batches (`complete`)."""
