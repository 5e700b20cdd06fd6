"""The transformers engine's tensor steps: sampling one token per row, and the prefill.

Invariants:
- `sample_tokens` reports the log-prob of the sampled token under the tempered FULL distribution
  (top_p / top_k only restrict what may be sampled); temperature 0 is the argmax with
  log_softmax(logits)[argmax] (see actors/engines/hf.py).
- `prefill` left-pads its sequences with explicit position ids, so a row's logits do not depend on
  the other rows; `expand` (row -> sequence) copies a sequence's cache to each of its rows.
"""
from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its log-prob under the tempered full distribution.

    logits (R, V) float32; temperature, top_p (R,) float; top_k (R,) long (<= 0: off).
    Rows with temperature 0 take the argmax and report log_softmax(logits)[argmax].
    """
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / safe_t[:, None], dim=-1)
    vocab = logits.shape[-1]
    filtered = logp
    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    use_p = (top_p < 1) & ~greedy
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
        if bool(use_k.any()):
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            remove |= use_k[:, None] & (ranks >= top_k.clamp(min=1)[:, None])
        if bool(use_p.any()):
            probs = sorted_lp.exp()
            before = probs.cumsum(-1) - probs  # mass strictly before each token
            remove |= use_p[:, None] & (before >= top_p[:, None])
        remove[:, 0] = False  # the most likely token always stays
        mask = torch.zeros_like(remove).scatter(1, order, remove)
        filtered = logp.masked_fill(mask, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


@torch.no_grad()
def prefill(model, seqs: list[list[int]], pad_id: int, device: torch.device, cache_kw: str,
            expand: list[int] | None = None):
    """(last-position logits, cache, attention mask, last position) per row; rows = `expand` over seqs."""
    from transformers import DynamicCache

    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, width - len(x):] = torch.tensor(x)
        attn[i, width - len(x):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    logits = out.logits[:, -1, :].float()
    if expand is not None:
        index = torch.tensor(expand, device=device)
        cache.batch_select_indices(index)
        logits, attn, pos = logits[index], attn[index], pos[index]
    return logits, cache, attn, pos[:, -1]
