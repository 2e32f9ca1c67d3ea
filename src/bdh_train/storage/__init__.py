"""Where bdh-train's commands write, and how: the names of a run's and a checkpoint's files
(`places`), which no output replaces or enters, and the one output policy (`output`): an
output never replaces what the command did not create unless the user says so (--force, or
the command's own flag), --force replaces only a regular file or a directory of the same
kind, never a device, FIFO, link, run or checkpoint; a file is written through a temporary
and renamed, a directory is built beside its place and renamed into it
(`output.rename_into_place`, which a run's checkpoints are published by too: `checkpoint`,
their manifest and its checks: `manifest`), and the next command of the same kind removes
what a killed one left."""
