"""Training a run: `Trainer` assembles the model, data, step, window, checkpoints, evaluation
and console and loops; `launch` owns the process around it (the run directory's lock, torchrun,
signals, what a stop leaves)."""
