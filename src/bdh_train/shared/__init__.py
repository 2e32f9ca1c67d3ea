"""What the applications share: loading a trained run for use (`loading.load_run`: a run, a
checkpoint or a ternary export, with its tokenizer and config) and choosing torch's CPU
threads (`threads.set_threads`)."""
