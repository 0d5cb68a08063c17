"""The Transformer family: the encoder-decoder, decoder-only models, attention, its cache and
variants, positions, mixture of experts, Pallas attention, the dropout PRNG and FLOP counts.

Imports nothing of data, training, decoding, the search or a command."""
