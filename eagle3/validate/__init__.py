"""Stage: validate a draft checkpoint (contract, real vLLM speculative decoding, offline parity, report)."""
