"""eagle3-pipeline library: plain Python + PyTorch, no Prefect.

Stages (one module each): data -> capacity -> extract -> vocab -> model/train/checkpoint -> validate.
Layer ids everywhere use vLLM's convention: id k = the residual stream ENTERING decoder layer k
(= Hugging Face ``output_hidden_states[k]``; index 0 is the embedding output).
"""

__version__ = "0.1.0"
