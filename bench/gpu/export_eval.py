"""An export that vLLM and transformers both load unchanged, scored by `launch.eval --model` with each.

    python -m bench.gpu.export_eval [--work DIR] [--engines vllm,transformers] [--sft-steps 150]

Builds everything here (nothing downloaded): a synthetic BIRD directory, the project's tiny tokenizer
and a small Qwen3-shaped decoder (hidden 256, 4 layers, head_dim 64: shapes every vLLM attention
backend takes), `--sft-steps` of cross-entropy on the train split's gold SQL (so greedy answers are
SQL worth scoring), then an export through launch.export's atomic commit (bf16 safetensors + the
tokenizer + arctic_rl.json), exactly the layout a run writes under runs/<id>/hf/step_<N>. Then it
runs `python -m launch.eval --model EXPORT --split dev --engine E` once per engine and prints each
engine's execution accuracy and how many greedy predictions the engines agree on, token for token
(bf16 kernels differ between engines, so a few near-ties may flip). On a machine without vLLM,
`--engines transformers` checks the same plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"prompt_style": "compact", "sample_values": 0, "max_prompt_tokens": 256, "use_chat_template": False,
            "max_tokens": 48, "stop": [], "temperature": 1.0}


def build_export(work: Path, sft_steps: int, device: str) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from config import ModelConfig
    from launch.export import begin_export, commit_export
    from queues.messages import unpack_ids
    from tasks.bird import build_prompts, load_split
    from tasks.synthetic import texts_for_tokenizer, write_dataset
    from tasks.tiny_model import build_tiny

    bird = write_dataset(work / "bird", num_databases=3, num_questions=240, seed=5)
    shape = ModelConfig(source="tiny", tiny_hidden_size=256, tiny_layers=4, tiny_heads=4, tiny_kv_heads=2,
                        tiny_intermediate_size=512, tiny_vocab_size=640)
    base = build_tiny(str(work / "base"), texts_for_tokenizer(bird), seed=0, model_cfg=shape)
    tok = AutoTokenizer.from_pretrained(base)
    items, _ = build_prompts(load_split(bird, "train"), tok, SETTINGS["max_prompt_tokens"], style="compact",
                             sample_values=0)
    seqs = [(unpack_ids(it.prompt_tokens).tolist(), tok.encode(" " + it.gold_sql, add_special_tokens=False)
             + [tok.eos_token_id]) for it in items]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    for step in range(sft_steps):
        batch = [seqs[(step * 16 + i) % len(seqs)] for i in range(16)]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, t) in enumerate(batch):
            ids[i, : len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p): len(p) + len(t)] = torch.tensor(t)
            attn[i, : len(p) + len(t)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"sft: {sft_steps} steps in {time.perf_counter() - t0:.1f} s, last loss {float(loss):.3f}", flush=True)
    final = work / "hf" / f"step_{sft_steps}"
    tmp = begin_export(final)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    commit_export(tmp, final, dict(SETTINGS), base)
    return final, Path(bird)


def run_eval(export: Path, bird: Path, engine: str, out: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "launch.eval", "--model", str(export), "--bird-dir", str(bird), "--split", "dev",
           "--engine", engine, "--device", device, "--out-dir", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    print(f"$ {' '.join(cmd)}\n{proc.stdout[-1500:]}{proc.stderr[-3000:] if proc.returncode else ''}", flush=True)
    if proc.returncode:
        return {"engine": engine, "ok": False, "seconds": seconds}
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    preds = json.loads((out / "predict_dev.json").read_text())
    return {"engine": engine, "ok": True, "seconds": seconds, "n": len(rows), "preds": preds,
            "accuracy": sum(bool(r.get("correct")) for r in rows) / max(1, len(rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/arl-export-eval")
    ap.add_argument("--engines", default="vllm,transformers")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    export, bird = build_export(work, args.sft_steps, device)
    print(f"export: {export} ({sorted(p.name for p in export.iterdir())})", flush=True)
    results = [run_eval(export, bird, e, work / f"eval-{e}", device) for e in args.engines.split(",") if e]
    print("\n| engine | loads the export | dev questions | execution accuracy | eval wall s |\n| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['engine']} | {'yes' if r['ok'] else 'NO'} | {r.get('n', '-')} | "
              f"{100 * r.get('accuracy', 0):.1f} % | {r['seconds']:.1f} |")
    ok = [r for r in results if r["ok"]]
    if len(ok) == 2:
        a, b = ok[0]["preds"], ok[1]["preds"]
        same = sum(a.get(k) == b.get(k) for k in a)
        print(f"\ngreedy predictions identical between {ok[0]['engine']} and {ok[1]['engine']}: {same}/{len(a)}")
    sys.exit(0 if len(ok) == len(results) else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
