"""Data: sources, the tokenizer, the token cache, batching and packing, and the exact-resume
pipeline that puts them together.

Imports nothing of the model, training, decoding, the search or a command."""
