"""Greedy and beam search over the decode cache, and the batched translator."""
