"""Stage: the verifier rewrites every assistant turn of the training conversations (on-policy data), through vLLM."""
