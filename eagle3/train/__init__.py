"""Stage: train the EAGLE-3 draft on the hidden-state store (training-time test)."""
