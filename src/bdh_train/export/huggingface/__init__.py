"""Hugging Face export: `export.export_hf` writes a run, checkpoint or ternary export as a
transformers model directory; `configuration_bdh.py` and `modeling_bdh.py` are the custom
code copied into it (they need only torch and transformers, never bdh_train)."""
