"""Sentence embeddings: the bundled all-MiniLM-L6-v2, its ONNX encoder, and the static embedding distilled from it."""
