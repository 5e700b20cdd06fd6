"""A tokenizer and a random-init Qwen3 model small enough to build in seconds on a CPU.

Invariants:
- Everything is built locally (the `tokenizers` BPE trainer and `Qwen3Config`): nothing is
  downloaded, and the same inputs and seed give the same tokenizer and the same weights.
- The tokenizer is byte-level BPE, so any text round-trips; `<|endoftext|>` is both eos and pad,
  and the chat template renders messages as plain "role: content" lines.
- The saved directory loads with `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM`.

Used by the `tiny` recipe, the tests and the benchmarks. Tests call `build_tiny(dir)` from a
session-scoped fixture in their own module (tests/conftest.py is shared and stays small).
"""
from __future__ import annotations

import os
from typing import Iterable

EOS = "<|endoftext|>"

# Renders messages as plain text; add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_DEFAULT_TEXTS = [
    "SELECT name FROM singer WHERE age > 30 ORDER BY name;",
    "SELECT COUNT(*) FROM orders WHERE status = 'shipped';",
    "SELECT T1.title, T2.name FROM books AS T1 JOIN authors AS T2 ON T1.author_id = T2.id;",
    "SELECT AVG(price) FROM products GROUP BY category HAVING COUNT(*) > 2;",
    "Question: How many students are older than 20? Answer with one SQLite query.",
    "Database schema: CREATE TABLE student (id INTEGER PRIMARY KEY, name TEXT, age INTEGER);",
    "user: Which city has the most customers?\nassistant: SELECT city FROM customer GROUP BY city ORDER BY COUNT(*) DESC LIMIT 1;",
    "The quick brown fox jumps over the lazy dog. 0123456789 ()[]{},.;:'\"<>=!+-*/%_",
]


def build_tokenizer(texts: Iterable[str] | None, vocab_size: int, out_dir: str):
    """Trains a byte-level BPE tokenizer on `texts`, saves it to `out_dir`, returns it
    as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(texts) if texts is not None else []
    corpus = corpus + _DEFAULT_TEXTS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def build_model(model_cfg, tokenizer, out_dir: str, seed: int = 0):
    """A random-init Qwen3ForCausalLM with the `tiny_*` shape of `model_cfg`, saved to `out_dir`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = model_cfg.tiny_heads
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.tiny_hidden_size,
        intermediate_size=model_cfg.tiny_intermediate_size,
        num_hidden_layers=model_cfg.tiny_layers,
        num_attention_heads=heads,
        num_key_value_heads=model_cfg.tiny_kv_heads,
        head_dim=model_cfg.tiny_hidden_size // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return model


def built(out_dir: str) -> bool:
    """Whether `out_dir` already holds a tiny tokenizer and model (build_tiny reuses it then)."""
    return all(os.path.exists(os.path.join(str(out_dir), f)) for f in ("config.json", "tokenizer.json"))


def build_tiny(out_dir: str, texts: Iterable[str] | None = None, seed: int = 0, model_cfg=None) -> str:
    """Tokenizer + model in one directory (what `model.path` points at); returns the directory.
    Idempotent: a directory that already holds both is reused."""
    out_dir = str(out_dir)
    if built(out_dir):
        return out_dir
    if model_cfg is None:
        from config import ModelConfig

        model_cfg = ModelConfig(source="tiny")
    cfg = model_cfg
    tok = build_tokenizer(texts, cfg.tiny_vocab_size, out_dir)
    build_model(cfg, tok, out_dir, seed=seed)
    return out_dir
