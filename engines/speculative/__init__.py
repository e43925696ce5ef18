"""Speculative decoding in the decode batch: proposals verified in one forward per step."""
