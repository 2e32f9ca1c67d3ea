"""Writing a trained run in another format: ternary weights packed four per byte
(`ternary.export_ternary`) and a Hugging Face transformers directory (`huggingface`)."""
