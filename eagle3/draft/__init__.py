"""The draft model and its checkpoint: the contract vLLM loads (shared by training and validation)."""
