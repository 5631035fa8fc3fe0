"""Build tiny random Llama checkpoints (model + working tokenizer) offline, for tests.

The checkpoint looks like a real Hugging Face one: config.json, generation_config.json,
safetensors (optionally sharded with an index), tokenizer.json, tokenizer_config.json and a
chatml chat template, so every loader and tokenizer path is exercised without downloads.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a one some every cat dog model server adapter token batch query table user admin "
    "runs reads writes serves loads stores answers sends quickly slowly today again here "
    "red blue green small large fast quiet old new is was and or but with from into over "
    "Paris France capital city river what who how why please hello world SELECT FROM WHERE"
).split()
_EXTRA = [
    "héllo wörld",
    "naïve café",
    "日本語 テキスト",
    "emoji 😀 🚀 ✨",
    "数字 123 456",
    "x = y + 1;",
]


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    return lines + _EXTRA * 5


def make_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (special tokens are 0..3)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(400, seed), trainer=trainer)
    # Training may stop short of the target; pad with plain added tokens so the tokenizer
    # covers every row of the model's embedding.
    short = vocab_size - tok.get_vocab_size()
    if short < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    if short:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(short)])
    assert tok.get_vocab_size() == vocab_size
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def make_tiny_llama(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    seed: int = 0,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.2,
    sharded: bool = False,
) -> Path:
    """Save a random float32 LlamaForCausalLM plus a matching tokenizer into `path`.

    eos is `</s>` (id 1) in config.json and the tokenizer; generation_config.json lists both
    `</s>` and `<|im_end|>` (ids 1 and 3), as chat models do. initializer_range 0.2 (not HF's
    0.02) keeps greedy continuations prompt-dependent instead of one repeated token, and
    widens logit gaps so float rounding rarely flips a greedy choice.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size, seed)
    bos_id, eos_id = tokenizer.convert_tokens_to_ids([BOS, EOS])
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )
    # A small shard size splits even this tiny model into several files + an index json.
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "50GB")
    tokenizer.save_pretrained(path)
    return path


def make_tiny_family(
    path: str | Path,
    model_type: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    initializer_range: float = 0.2,
    **config_fields,
) -> Path:
    """Save a random float32 checkpoint of any transformers `model_type` (llama, qwen2, qwen3,
    mistral, gemma2, ...) plus the tiny tokenizer. Defaults give a 2-layer, 64-wide GQA model;
    `config_fields` override or add config fields (rope_parameters, sliding_window, ...).

    Biases and norm weights are randomised too (transformers initialises them to 0 and 1), so
    a model that ignored a bias or a q/k norm would compute different tokens.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size, seed)
    bos_id, eos_id = tokenizer.convert_tokens_to_ids([BOS, EOS])
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=initializer_range,
                  rms_norm_eps=1e-6, bos_token_id=bos_id, eos_token_id=eos_id,
                  pad_token_id=eos_id, tie_word_embeddings=False)
    fields.update(config_fields)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
