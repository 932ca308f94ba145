"""A tiny package whose hook keeps its state in a helper module (for --isolate)."""
