"""Looking inside a BDH: sparsity (activity.py), neuron graphs (graph.py, heavy_tail.py),
synapses and the concept probe (synapses.py), the report (report.py) and the whole
inspection (run.py: `inspect_model` for notebooks, `inspect_checkpoint` for the CLI)."""
