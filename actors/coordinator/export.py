"""Hugging Face exports of a run and checkpoint pruning: the format the coordinator writes and
launch.eval / launch.serve read (launch/export.py loads an export into an engine).

Layout: <run_dir>/hf/step_<N>/ holds the weights after N training steps as transformers and vLLM
load them (safetensors, config.json, generation_config.json, tokenizer files; a LoRA run's: the PEFT
adapter, adapter_config.json naming its base + adapter_model.safetensors, see actors/lora.py) plus `arctic_rl.json`:
how training rendered prompts and sampled (prompt style, schema sample values, prompt budget, chat
template, max new tokens, stop strings), which `launch.eval --model` and `launch.serve` reuse.

Invariants:
- An export directory is complete or absent: it is written under a `.tmp-` name in the same parent
  and renamed into place (one rename on one filesystem); a crash leaves at most a `.tmp-`
  directory, which the next export of that step removes and nothing reads. A re-export of a step
  replaces the old directory only once the new one is complete.
- Pruning keeps the `keep` newest DeepSpeed checkpoints (by step) and, always, the one the
  `latest` marker names (what a resume loads); keep=0 keeps every checkpoint. It runs only after
  the marker names a complete checkpoint. HF exports are never pruned.
- Deciding is pure (`checkpoints_to_prune`, `inference_settings`); the IO around it is small.
- A model directory that is not an export (no `arctic_rl.json`, e.g. a hub model) gets the BIRD
  defaults (omnisql prompts through the chat template); a directory without config.json is one
  ExportError line naming the path.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from config import RunConfig, layout

SETTINGS_FILE = "arctic_rl.json"
ADAPTER_CONFIG = "adapter_config.json"  # actors/lora.py's (a LoRA run exports its adapter, not a whole model)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Files of the source model directory an export needs besides the weights and config.
_SIDE_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template", "generation_config",
               "preprocessor_config")

# What a model that was not trained here gets (BIRD's omnisql prompt, a reasoning model's budget).
DEFAULT_SETTINGS = {"prompt_style": "omnisql", "sample_values": 3, "max_prompt_tokens": 8192,
                    "use_chat_template": True, "max_tokens": 4096, "stop": [], "temperature": 1.0,
                    "max_turns": 1, "max_observation_tokens": 128}


class ExportError(ValueError):
    """A one-line, user-facing problem with a model directory."""


# -- writing ---------------------------------------------------------------------------------------


def export_dir(run_dir: str | Path, steps_done: int) -> Path:
    """Where the weights after `steps_done` training steps go: <run_dir>/hf/step_<N>."""
    return layout.export_dir(run_dir, steps_done)


def _tmp_name(final: Path) -> Path:
    return final.parent / f".tmp-{final.name}"


def begin_export(final: str | Path) -> Path:
    """An empty temp directory beside `final` for the writer (a stale one from a crash is removed)."""
    final = Path(final)
    tmp = _tmp_name(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_export(tmp: str | Path, final: str | Path, settings: dict[str, Any],
                  source: str | Path | None = None) -> Path:
    """Adds the settings file (and any tokenizer / chat template / generation config file of the
    `source` model directory the writer did not copy) to a fully written temp directory and renames
    it to `final`."""
    tmp, final = Path(tmp), Path(final)
    if not _is_model_dir(tmp):
        raise ExportError(f"export {tmp} has no config.json (nor adapter_config.json): the writer did not finish; "
                          f"nothing was renamed")
    if source is not None and Path(source).is_dir():
        for f in Path(source).iterdir():
            if f.is_file() and f.name.startswith(_SIDE_FILES) and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
    (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=1, sort_keys=True))
    _fsync_tree(tmp)
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _is_model_dir(path: Path) -> bool:
    """A full model (config.json) or a LoRA run's export (a PEFT adapter: adapter_config.json, naming its base)."""
    return (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file()


def write_atomic(path: str | Path, text: str) -> None:
    """A small file replaced whole (temp file + fsync + rename): readers see the old or the new text."""
    path = Path(path)
    tmp = path.parent / f".tmp-{path.name}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def source_model_dir(cfg: RunConfig, run_dir: str | Path) -> Path | None:
    """The directory the run's model (and tokenizer) came from: the tiny build under the run, or model.path."""
    if cfg.model.source == "tiny":
        return layout.model_dir(run_dir)
    src = cfg.model.tokenizer or cfg.model.path
    return Path(src) if src and Path(src).is_dir() else None


def _fsync_tree(path: Path) -> None:
    for name in os.listdir(path):
        p = path / name
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def prompt_style(cfg: RunConfig) -> str:
    """The training prompts' style: compact for the tiny model, omnisql otherwise (as launch.run renders)."""
    return "compact" if cfg.model.source == "tiny" else "omnisql"


def inference_settings(cfg: RunConfig, run_id: str = "", steps_done: int = 0) -> dict[str, Any]:
    """What an export records about how its run rendered prompts and sampled."""
    style = prompt_style(cfg)
    return {"prompt_style": style, "sample_values": int(cfg.data.sample_values),
            "max_prompt_tokens": int(cfg.data.max_prompt_tokens), "use_chat_template": style != "compact",
            "max_tokens": int(cfg.generator.max_tokens), "stop": list(cfg.generator.stop),
            "temperature": float(cfg.generator.temperature), "max_turns": int(cfg.generator.max_turns),
            "max_observation_tokens": int(cfg.generator.max_observation_tokens),
            "run_id": run_id, "steps_done": int(steps_done)}


# -- pruning ---------------------------------------------------------------------------------------


def checkpoints_to_prune(names: list[str], keep: int, latest: str | None) -> list[str]:
    """The step_* names to delete: all but the `keep` newest and the one `latest` names (keep=0: none)."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (coordinator.keep_checkpoints / keep_exports), got {keep}")
    steps = sorted((int(m.group(1)), n) for n in names if (m := _STEP_DIR.match(n)))
    if keep == 0 or len(steps) <= keep:
        return []
    kept = {n for _, n in steps[-keep:]}
    return [n for _, n in steps if n not in kept and n != latest]


def prune_checkpoints(checkpoints_root: str | Path, keep: int) -> list[Path]:
    """Deletes what checkpoints_to_prune names under <run_dir>/checkpoints; returns what it deleted."""
    root = Path(checkpoints_root)
    marker = root / "latest"
    latest = marker.read_text().strip() if marker.is_file() else None
    if latest is None:
        return []  # no complete checkpoint yet: nothing is provably safe to delete
    names = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    doomed = [root / n for n in checkpoints_to_prune(names, keep, latest)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def prune_exports(hf_root: str | Path, keep: int) -> list[Path]:
    """Deletes all but the `keep` newest complete exports under <run_dir>/hf (keep=0: none); returns them."""
    root = Path(hf_root)
    names = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    doomed = [root / n for n in checkpoints_to_prune(names, keep, None)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# -- reading back (eval, serve) --------------------------------------------------------------------


def read_settings(model_dir: str | Path) -> dict[str, Any]:
    """The export's inference settings over DEFAULT_SETTINGS (ExportError for a non-model directory)."""
    path = Path(model_dir)
    if not _is_model_dir(path):
        raise ExportError(f"model directory {path} has no config.json (expected a Hugging Face export, "
                          f"e.g. runs/<run>/hf/step_<N>, or a LoRA adapter export with adapter_config.json)")
    settings = dict(DEFAULT_SETTINGS)
    f = path / SETTINGS_FILE
    if f.is_file():
        try:
            settings.update(json.loads(f.read_text()))
        except ValueError as e:
            raise ExportError(f"{f}: not valid JSON ({str(e).splitlines()[0]})") from None
    return settings


def latest_export(run_dir: str | Path) -> Path | None:
    """The export with the most steps under <run_dir>/hf (None when there is none)."""
    root = layout.exports_dir(run_dir)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else []) if (m := _STEP_DIR.match(p.name))]
    return max(found)[1] if found else None
