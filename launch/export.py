"""Loading a run's Hugging Face export for eval and serve, and the end-of-run next steps.

The export format itself (layout, atomic commit, pruning, `arctic_rl.json` settings) lives in
actors/coordinator/export.py, which the coordinator writes through; its names are re-exported here
for launch's callers.

Invariants:
- `load_engine` builds the project's own engine classes (actors/engines) over an export, greedy by
  default, max new tokens from the export's settings unless given.
- A directory that is not a loadable export is one ExportError line naming the path.
- A LoRA run's export (a PEFT adapter naming its base, actors/lora.py) loads like any other; `python -m
  launch.export --merge <export> --out <dir>` writes it merged into its base, a plain model directory.
"""
from __future__ import annotations

from pathlib import Path

from actors.coordinator.export import (  # noqa: F401  (re-exported)
    DEFAULT_SETTINGS,
    SETTINGS_FILE,
    ExportError,
    begin_export,
    checkpoints_to_prune,
    commit_export,
    export_dir,
    inference_settings,
    latest_export,
    prompt_style,
    prune_checkpoints,
    prune_exports,
    read_settings,
    source_model_dir,
    write_atomic,
)


def next_steps(run_dir: str | Path, bird_dir: str | Path, split: str) -> str:
    """The end-of-run lines that say how to evaluate and serve the run's final export ("" without one)."""
    export = latest_export(run_dir)
    if export is None:
        return ""
    from launch.commands import command

    args = ("--model", export, "--bird-dir", bird_dir, "--split", split)
    return (f"\nevaluate: {command('launch.eval', *args)}\nserve:    {command('launch.serve', *args)}"
            f"\nexport:   {export}")


def default_engine() -> str:
    """vllm where a GPU and vLLM are present, transformers otherwise."""
    import importlib.util

    import torch

    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None else "transformers"


def load_engine(model_dir: str | Path, engine: str = "", device: str = "auto", max_batch_prompts: int = 16,
                max_tokens: int = 0, seed: int = 0, engine_kwargs: dict | None = None):
    """(engine, tokenizer, settings) for an export: the project's own engine classes (actors/engines),
    greedy by default, max new tokens from the export unless given; an episode's observations are cut
    as in training (the export's max_observation_tokens)."""
    from transformers import AutoTokenizer

    from actors.engines.hf import resolve_device
    from actors.engines.registry import make_engine
    from config import GeneratorConfig, ModelConfig

    settings = read_settings(model_dir)
    engine = engine or default_engine()
    on_gpu = engine == "vllm" or resolve_device(device).type == "cuda"
    gen = GeneratorConfig(engine=engine, device=device, n_samples=1, temperature=0.0,
                          max_tokens=int(max_tokens or settings["max_tokens"]), stop=list(settings["stop"]),
                          max_observation_tokens=int(settings["max_observation_tokens"]),
                          max_batch_prompts=max_batch_prompts, seed=seed, engine_kwargs=dict(engine_kwargs or {}))
    model = ModelConfig(path=str(model_dir), dtype="bfloat16" if on_gpu else "float32")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ExportError(f"model directory {model_dir}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    return make_engine(gen, model, str(model_dir)), tokenizer, settings


def main(argv: list[str] | None = None) -> int:
    """`python -m launch.export --merge EXPORT --out DIR`: a LoRA export merged into its base (exit 2: bad input)."""
    import argparse
    import sys

    from actors import lora
    from observe.logs import quiet_cpu_host

    quiet_cpu_host()  # peft imports DeepSpeed: no accelerator WARNING before the `merged:` line

    p = argparse.ArgumentParser(prog="python -m launch.export", description=main.__doc__)
    p.add_argument("--merge", required=True, help="a LoRA run's export (runs/<run>/hf/step_<N>)")
    p.add_argument("--out", required=True, help="the merged model's directory (must not exist)")
    args = p.parse_args(argv)
    if not lora.is_adapter_dir(args.merge):
        print(f"error: {args.merge} is not a LoRA export (no adapter_config.json)", file=sys.stderr)
        return 2
    if Path(args.out).exists():
        print(f"error: {args.out} exists; name a new directory", file=sys.stderr)
        return 2
    try:
        out = lora.merge_export(args.merge, args.out)
    except (OSError, ValueError) as e:
        print(f"error: {args.merge}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"merged: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
