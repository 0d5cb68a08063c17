"""Every configuration key of t2t_jax, one comment each. Other configs start from here."""

import ml_collections


def get_config():
  """Returns the full set of keys with the paper's base recipe where one applies."""
  config = ml_collections.ConfigDict()
  config.name = 'base'  # Run name, printed in logs, the dry run and the final JSON line.
  config.seed = 0  # Seeds parameter init, dropout and data shuffling.

  data = config.data = ml_collections.ConfigDict()
  # 'synthetic' (built-in task), 'text' (two files), 'tsv', 'tfds', 'lm': language modelling on
  # text files (train_text/eval_text below; model.kind='decoder_only', or 'encoder_only' for
  # masked-LM pre-training), or 'labelled': text and labels for a classifier (train_tsv and
  # eval_tsv below: text, optional text2, label; model.kind='encoder_only').
  data.source = 'synthetic'
  data.task = 'reverse'  # Synthetic task: 'copy', 'reverse', 'sort' or 'addition'.
  data.num_symbols = 16  # Synthetic: distinct symbols for copy/reverse/sort.
  data.min_length = 1  # Synthetic: shortest source, in symbols (digits per operand for addition).
  data.max_length = 20  # Synthetic: longest source, in symbols (digits per operand for addition).
  data.num_train = 50_000  # Synthetic: training examples generated from the seed.
  data.num_eval = 512  # Synthetic: held-out examples, none of which occurs in training.
  data.data_dir = ''  # Folder that relative text/TSV paths below are read from; '' is the cwd.
  data.train_src = ''  # Text: training source file, one sentence per line.
  data.train_tgt = ''  # Text: training target file, line-aligned with train_src.
  data.eval_src = ''  # Text: evaluation source file.
  data.eval_tgt = ''  # Text: evaluation target (reference) file.
  # Text: more training pairs beside train_src/train_tgt (e.g. back-translations), comma-separated
  # files, line-aligned pairwise; docs/backtranslation.md.
  data.extra_src = ''
  data.extra_tgt = ''  # Text: the extra_src files' targets, in the same order.
  # Text: times each training part is read per epoch, train_src's then each extra_src's, e.g.
  # '2,1' (real pairs upsampled); a fraction reads that share (a fixed draw); '': each once.
  data.mix_weights = ''
  data.extra_tag = ''  # Text: a piece put before every extra_src line (tagged back-translation).
  data.train_tsv = ''  # TSV: training file of 'source<TAB>target' lines.
  data.eval_tsv = ''  # TSV: evaluation file of 'source<TAB>target' lines.
  data.train_text = ''  # LM: training text file(s), comma-separated, one sequence per line.
  data.eval_text = ''  # LM: evaluation text file, one sequence per line.
  data.tfds_name = 'wmt14_translate/de-en'  # TFDS: dataset/config, e.g. 'wmt17_translate/de-en'.
  data.tfds_eval_name = ''  # TFDS: dataset of the eval and test splits; '' means tfds_name.
  data.tfds_train_split = 'train'  # TFDS: training split (any TFDS split spec).
  data.tfds_eval_split = 'validation'  # TFDS: eval split (newstest2013 in wmt14_translate).
  data.tfds_test_split = 'test'  # TFDS: test split (newstest2014 in wmt14_translate).
  data.tfds_data_dir = ''  # TFDS: data_dir holding prepared datasets; '' is TFDS's default.
  data.tfds_manual_dir = ''  # TFDS: manual_dir for sources that cannot be downloaded.
  data.source_lang = 'en'  # TFDS: feature translated from (direction: source_lang -> target_lang).
  data.target_lang = 'de'  # TFDS: feature translated to.
  data.cache_dir = ''  # Vocabulary and token cache; '' means the workdir. Share it across runs.
  data.vocab_path = ''  # SentencePiece model; '' means <cache_dir>/vocab.model, trained if absent.
  data.vocab_size = 8000  # Size of the shared SentencePiece vocabulary.
  data.vocab_type = 'unigram'  # SentencePiece model type: 'unigram' or 'bpe'.
  data.vocab_sample_chars = 10_000_000  # Characters sampled across both sides to train the vocab.
  data.bad_lines = 'error'  # Bad lines/pairs: 'error' names file and line, 'skip' logs counts.
  # Pairs longer than this (tokens incl. EOS) on either side are dropped; for a decoder-only
  # model, pairs whose source and target together are longer (the one sequence it reads).
  data.max_len = 256
  data.batch_tokens = 4096  # Tokens per global batch: rows x padded length, max of both sides.
  data.bucket_scale = 1.1  # Length buckets grow geometrically by this factor (tensor2tensor).
  data.min_bucket = 8  # Shortest bucket length; also the granularity of bucket lengths.
  data.batching = 'buckets'  # 'buckets': token budget per length bucket; 'packed': packed rows.
  data.pack_length = 0  # Packed: row length in tokens; 0 means max_len.
  # Rows of every train batch are a multiple of this, so a run may resume on any mesh whose
  # batch shards x opt.grad_accum_steps divide it; 0: those of the mesh the run starts on.
  data.row_multiple = 0
  data.mlm_rate = 0.15  # Masked LM: fraction of each row's tokens chosen (80% [MASK], 10% random).
  data.whole_word_masking = False  # Masked LM: choose whole words (SentencePiece word starts).
  # Labelled: the label names in order; () reads them from the training file (sorted) and the
  # run saves them here. A regression head (model.head) has none.
  data.labels = ()
  data.holdout = 0.0  # Labelled: this fraction of train_tsv (fixed draw) is the eval split instead.
  data.train_limit = 0  # Labelled: train on at most this many examples (a fixed draw); 0: all.

  model = config.model = ml_collections.ConfigDict()
  model.d_model = 512  # Width of embeddings and of every residual stream.
  model.d_ff = 2048  # Hidden width of the position-wise feed-forward layers.
  model.num_heads = 8  # Attention heads; d_model must be divisible by it.
  model.num_encoder_layers = 6  # Encoder blocks.
  model.num_decoder_layers = 6  # Decoder blocks.
  model.dropout = 0.1  # Residual dropout: sublayer outputs and embeddings + positions.
  model.attention_dropout = 0.1  # Dropout on attention weights (tensor2tensor v3).
  model.relu_dropout = 0.1  # Dropout after the feed-forward ReLU (tensor2tensor v3).
  # PRNG of the dropout masks: 'hash32' (cheapest), 'threefry2x32' (JAX's default), 'rbg' or
  # 'unsafe_rbg'. All are deterministic: a resumed run draws the same masks (docs/performance.md).
  model.dropout_prng = 'hash32'
  model.share_embeddings = True  # One embedding matrix for source and target tokens.
  model.tie_output = True  # Output softmax reuses the target embedding matrix.
  model.norm = 'post'  # 'post': LN(x + sublayer(x)) as in the paper; 'pre': x + sublayer(LN(x)).
  model.max_len = 512  # Longest sequence the position table covers (training and decoding).
  model.scan_layers = False  # Scan one compiled layer over each stack; params get a 'layers' axis.
  model.remat = 'none'  # Backward pass recomputes layers: 'none', 'full' or 'dots' (keeps matmuls).
  model.dtype = 'float32'  # Activations: 'float32', 'bfloat16' or 'auto' (bf16 on GPU/TPU).
  model.param_dtype = 'float32'  # Storage dtype of parameters.
  # Attention: 'einsum' (explicit softmax, attention dropout), 'xla' or 'cudnn' (fused, through
  # jax.nn.dot_product_attention), 'pallas' (TPU splash attention; interpreted on CPU); the
  # fused ones have no attention dropout. 'auto' (cuDNN where it applies).
  model.attention_impl = 'auto'
  # 'encoder_decoder' (the paper) or 'decoder_only' (Transformer-D, Liu et al. 2018: one stack
  # of num_decoder_layers over source + target; num_encoder_layers is ignored).
  # 'encoder_only' (BERT: one bidirectional stack of num_encoder_layers and one head).
  model.kind = 'encoder_decoder'
  # Encoder-only head: 'mlm' (masked-LM pre-training), 'electra' (ELECTRA's replaced-token
  # detection, Clark et al. 2020), 'classification' or 'regression'.
  model.head = 'mlm'
  model.num_labels = 0  # Encoder-only classification: labels (set from data.labels when 0).
  model.type_vocab_size = 0  # Encoder-only: token-type (segment) embeddings (BERT: 2); 0: none.
  model.pooling = 'cls'  # Encoder-only heads read the first ([CLS]) token's state, or its 'mean'.
  # Encoder-only pre-training: also next-sentence prediction (BERT; RoBERTa dropped it): each
  # example is two lines, [CLS] A [SEP] B, B the line after A half the time, else a random one.
  model.next_sentence = False
  # ELECTRA pre-training (head 'electra'): the generator's own layers, over the shared
  # embeddings (the paper narrows its generator instead; this one is shallower).
  model.generator_layers = 1
  # Decoder-only: 'causal' (every position sees only earlier ones) or 'full' (the source part
  # also sees later source positions: a prefix LM). Target positions are causal either way.
  model.prefix_attention = 'causal'
  # Mixture of experts (t2t_jax/model/moe.py): chosen feed-forward layers become `moe_experts` experts.
  model.moe_experts = 0  # Experts per MoE layer; 0 keeps a dense feed-forward in every layer.
  model.moe_top_k = 2  # Experts each token goes to (1: Switch, 2: GShard); at most moe_experts.
  model.moe_capacity_factor = 1.25  # Slots = ceil(this x row length x top_k / experts); <=0: all.
  model.moe_layers = 'every_other'  # Per stack: 'all', 'every_other' (1, 3, ..) or '0,2' indices.
  model.moe_group_size = 0  # Tokens per routing group (capacity is per group); 0: the batch row.
  model.moe_aux_loss_weight = 0.01  # Weight of the load-balancing loss in the training loss.
  # Positions: 'sinusoidal' (paper), 'predictive' (the lecture's sinusoids, p=0.883), 'learned',
  # 'relative' (Shaw et al. 2018, in self-attention; needs einsum attention), 'rotary' (Su et
  # al. 2021, turns queries and keys), 'alibi' (Press et al. 2022, a linear bias per head; needs
  # einsum attention) or 'none'.
  model.positions = 'sinusoidal'
  model.max_relative_distance = 16  # Relative positions: distances clipped to +-this (k).
  # Self-attention kind per layer, comma-separated, repeated over each stack's layers: 'full',
  # 'local' (restricted to a window) or 'compressed' (Liu et al. 2018), e.g. 'local,compressed'.
  model.attention_pattern = 'full'
  model.local_half_width = 256  # Local: keys <= w away seen: 2w+1 keys (causal w+1); was local_window
  model.compression_stride = 3  # Compressed attention: kernel = stride of the key/value conv.

  opt = config.opt = ml_collections.ConfigDict()
  # 'rsqrt' (paper), 't2t' (linear warmup x rsqrt decay), 'constant', or 'linear' / 'cosine':
  # warmup to the rsqrt peak, then decay to final_lr_fraction of it at train.num_steps.
  opt.schedule = 'rsqrt'
  opt.lr_scale = 1.0  # Multiplies the schedule (paper 1.0, tensor2tensor v3 2.0).
  opt.warmup_steps = 4000  # Linear warmup length of the schedule.
  opt.final_lr_fraction = 0.0  # 'linear' / 'cosine': the rate at the end, over the peak's.
  opt.cooldown_steps = 0  # Any schedule: linear ramp to 0 over the last N of train.num_steps.
  opt.b1 = 0.9  # Adam beta1.
  opt.b2 = 0.98  # Adam beta2 (tensor2tensor v3: 0.997).
  opt.eps = 1e-9  # Adam epsilon.
  opt.grad_clip = 0.0  # Clip gradients to this global norm; 0 disables clipping.
  opt.weight_decay = 0.0  # Decoupled weight decay (AdamW); 0 gives plain Adam as in the paper.
  opt.decay_vectors = True  # Weight decay on biases and norms too; False: matrices only (BERT).
  # Layer-wise learning-rate decay (fine-tuning): encoder layer i of n learns at decay^(n - i),
  # the embeddings at decay^(n + 1), the head at 1; 1.0: off.
  opt.layer_lr_decay = 1.0
  # Top-level parameters that keep their starting values (fine-tuning), comma-separated, such
  # as 'embedding,embedder,type_embedding' for an encoder's embeddings; '': none.
  opt.frozen = ''
  # ELECTRA pre-training: the replaced-token loss's weight against the generator's masked-LM
  # loss (the paper's lambda, 50).
  opt.replaced_weight = 50.0
  opt.label_smoothing = 0.1  # Mass spread uniformly over the other vocabulary entries.
  opt.grad_accum_steps = 1  # Micro-batches per update; data.batch_tokens stays the whole batch.
  opt.loss_chunk_tokens = 512  # Output softmax + loss over chunks of this many tokens; 0: whole.
  # 'xla': the output layer and loss as XLA ops; 'fused' (GPU): as Pallas kernels that store no
  # [tokens, vocab] logits (training/fused_loss.py; opt.loss_chunk_tokens does not apply).
  opt.loss_impl = 'xla'
  opt.ema_decay = 0.0  # > 0: also keep, evaluate and save a moving average of the weights.

  train = config.train = ml_collections.ConfigDict()
  train.num_steps = 100_000  # Optimiser updates to run.
  train.log_every = 100  # Steps between training-metric logs.
  train.eval_every = 1000  # Steps between evaluations (also run at the last step).
  train.step_timeout_seconds = 1800.0  # A slower step dumps all thread stacks and exits; 0: off.
  # (first, last): a jax.profiler trace of these steps, inclusive, in <workdir>/profile; (): none.
  train.profile_steps = ()

  evaluation = config.eval = ml_collections.ConfigDict()
  evaluation.num_batches = 0  # Eval-loss batches per evaluation; 0 uses the whole eval set.
  evaluation.bleu_sentences = -1  # Eval sentences decoded for BLEU: -1 all, N the first N, 0 none.
  evaluation.bleu_every = 0  # Decode when the eval step is a multiple of this (and last); 0: all.
  evaluation.full_bleu_at_end = False  # At the last step decode every eval sentence regardless.
  evaluation.bleu_tokenize = '13a'  # sacreBLEU tokenizer; 'none' when references are tokenised.
  evaluation.bleu_lowercase = False  # Case-insensitive BLEU (lowercase hypotheses and references).
  evaluation.beam_size = 4  # Beam width for evaluation decoding; 1 is greedy.
  evaluation.alpha = 0.6  # Length penalty exponent: scores are log p / penalty(len) ** alpha.
  evaluation.length_penalty = 'gnmt'  # penalty: 'gnmt' (5 + len) / 6; 'length' len (CTranslate2's).
  evaluation.max_extra_len = 50  # Longest output = source length + this (capped by model.max_len).
  # Decoding activations: 'auto' (bfloat16 on GPU/TPU, float32 on CPU), 'model' (model.dtype),
  # 'float32' or 'bfloat16'.
  evaluation.dtype = 'auto'
  evaluation.examples_to_print = 3  # Example translations logged after each evaluation.
  evaluation.average_last = 0  # Also evaluate the mean of the last N checkpoints; 0: off.
  # Classifiers: the figure whose best step's parameters are kept in <workdir>/best_params:
  # 'accuracy', 'macro_f1' or 'mcc' (regression: 'pearson' or 'spearman').
  evaluation.best_metric = 'accuracy'

  ckpt = config.ckpt = ml_collections.ConfigDict()
  ckpt.every = 1000  # Steps between checkpoints (the last step is always saved); 0 disables.
  ckpt.keep = 5  # Most recent checkpoints kept.
  ckpt.keep_every = 0  # Also keep every checkpoint whose step is a multiple of this; 0: none.
  ckpt.preemption_grace_seconds = 25.0  # After SIGTERM: save, then exit within this many seconds.
  # Fresh runs start from these params (a step or averaged/exported dir). An encoder-only run
  # whose head differs from theirs (fine-tuning a pre-trained encoder) takes the arrays both
  # have and starts its head fresh.
  ckpt.init_from = ''

  mesh = config.mesh = ml_collections.ConfigDict()
  # Devices along ('data', 'fsdp', 'tensor', 'expert'); -1 takes what is left; 3 sizes: expert=1.
  mesh.shape = (-1, 1, 1)
  mesh.dcn_data = 1  # Slices (TPU) or processes (GPU) the data axis spans over the slow network.
  # GPUs: XLA combines a train step's gradient reduce-scatters and parameter all-gathers into
  # pieces of at most this many bytes, so each can start as its layer's gradients are ready
  # and overlap the rest of the step (docs/accelerators.md); 0: XLA's own combining.
  mesh.collective_combine_bytes = 0
  # Split the optimiser's moments (and the moving average) over 'data' as well: the gradients
  # are reduce-scattered, each data shard updates its part, the parameters are all-gathered
  # back (weight-update sharding, ZeRO stage 1). The same update; a data-th of its traffic.
  mesh.shard_update = False
  # Logical axis -> mesh axes. A mesh axis already used in an array goes to the next rule.
  mesh.rules = (
      ('expert', 'expert'),  # Mixture-of-experts weights and slots; before 'batch' claims it.
      ('batch', ('data', 'fsdp', 'expert')),
      ('batch', ('data', 'fsdp')),  # Arrays split over experts already: the rest of the batch.
      ('vocab', 'tensor'),
      ('mlp', 'tensor'),
      ('heads', 'tensor'),
      ('embed', 'fsdp'),
      ('kv', None),
      ('length', None),
      ('layers', None),  # The stacked layers of scan_layers: every device holds all of them.
  )
  return config
