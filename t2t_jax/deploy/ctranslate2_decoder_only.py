"""A t2t_jax decoder-only model (decoder_only.py, with causal prefix attention) as
CTranslate2's decoder-only model, `TransformerDecoderModelSpec`, which ctranslate2.Generator
runs.

t2t_jax's sequence is the source, EOS, the start token PAD, then the output: one causal stack
reads it with positions counting from 0 over the whole sequence, the output's continuing from
the source's. A Generator given that prompt, source pieces + ['</s>', '<pad>'], computes the
same function: CTranslate2 counts positions over the prompt and the output alike. The
refusals (prefix-LM attention, two embedding or learned position tables) are
export_ctranslate2.check_exportable's.
"""

import ctranslate2

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.deploy import ctranslate2_layers as layers
from t2t_jax.model.model_config import TransformerConfig


def prompt(source_pieces: list[str], tokens: list[str]) -> list[str]:
  """The Generator's start tokens for a source: its pieces, EOS, then the start token PAD.

  A language model (configs/lm.py) has no source, not even its EOS: its prompt is PAD alone,
  then any text to continue.
  """
  return list(source_pieces) + [tokens[EOS_ID], tokens[PAD_ID]]


def build_spec(config: TransformerConfig, params: dict, tokens: list[str],
               unk_token: str | None):
  """The TransformerDecoderModelSpec of a decoder-only model's `params` (unboxed, unrolled,
  float32 numpy); export_ctranslate2.build_spec checks that it is exportable first."""
  decoder = ctranslate2.specs.TransformerDecoderSpec(
      config.num_decoder_layers, config.num_heads, with_encoder_attention=False,
      **layers.decoder_options(config))
  spec = ctranslate2.specs.TransformerDecoderModelSpec(decoder)
  # One embedding (share_embeddings) and one position table serve source and target alike.
  layers.embed(decoder, decoder.embeddings, config, params, 'target')
  if config.norm == 'pre':
    layers.layer_norm(decoder.layer_norm, params['decoder_norm'])
  layers.decoder_layers(decoder, params, cross_attention=False)
  layers.output_layer(decoder, config, params)
  spec.register_vocabulary(tokens)
  spec.config.layer_norm_epsilon = layers.LAYER_NORM_EPSILON
  spec.config.bos_token = tokens[PAD_ID]  # The start token after the source, as in training.
  spec.config.eos_token = tokens[EOS_ID]
  spec.config.unk_token = unk_token if unk_token is not None else tokens[PAD_ID]
  return spec
