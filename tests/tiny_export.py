"""A tiny model export that answers some synthetic dev questions with SQL (for the eval and serve tests).

Built once per test process: a synthetic BIRD directory, the project's tiny model, a few seconds of
plain cross-entropy on the dev split's (compact prompt, gold SQL) pairs, save_pretrained, and the
arctic_rl.json a run's export carries (compact prompts, no chat template), written through
launch.export's atomic commit. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

_BUILT: dict[str, tuple[Path, Path]] = {}

SETTINGS = {"prompt_style": "compact", "sample_values": 0, "max_prompt_tokens": 256, "use_chat_template": False,
            "max_tokens": 40, "stop": [], "temperature": 1.0}


def build(root: Path, questions: int = 40, sft_steps: int = 60) -> tuple[Path, Path]:
    """(export dir, bird dir); reused within one process."""
    if "dir" in _BUILT:
        return _BUILT["dir"]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launch.export import begin_export, commit_export
    from queues.messages import unpack_ids
    from tasks.bird import build_prompts, load_split
    from tasks.synthetic import texts_for_tokenizer, write_dataset
    from tasks.tiny_model import build_tiny

    bird = write_dataset(root / "bird", num_databases=2, num_questions=questions, seed=3)
    base = build_tiny(str(root / "base"), texts_for_tokenizer(bird), seed=0)
    tok = AutoTokenizer.from_pretrained(base)
    items, _ = build_prompts(load_split(bird, "dev"), tok, SETTINGS["max_prompt_tokens"], style="compact",
                             sample_values=0)
    seqs = [unpack_ids(it.prompt_tokens).tolist() + tok.encode(" " + it.gold_sql, add_special_tokens=False)
            + [tok.eos_token_id] for it in items]
    starts = [len(unpack_ids(it.prompt_tokens)) for it in items]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few ms of work per step: more threads only contend on a loaded machine
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, k) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, k: len(s)] = torch.tensor(s[k:])
        attn[i, : len(s)] = 1
    model.train()
    for _ in range(sft_steps):
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    torch.set_num_threads(threads)
    final = root / "hf" / "step_1"
    tmp = begin_export(final)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    commit_export(tmp, final, dict(SETTINGS))
    _BUILT["dir"] = (final, bird)
    return final, bird
