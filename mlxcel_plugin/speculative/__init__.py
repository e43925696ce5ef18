"""Speculative decoding, the parts without MLX: settings, the n-gram proposer, the adaptive
controller and the counters (the verify forward is in ``engines/speculative/``)."""
