"""Hidden-state extraction: run the verifier over the prepared dataset and store, per sample, the aux states
(vLLM layer-id convention) and the final state before the final norm (docs/DESIGN.md, "Hidden-state store").

Readers import ``eagle3.store`` only (no model code). The extraction entry point is
``eagle3.extract.stage.extract_hidden_states``.
"""
