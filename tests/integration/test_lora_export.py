"""A LoRA run's export (a PEFT adapter over its base, actors/lora.py) through the project's CLIs: launch.eval
generates and scores with it as with a full export, `python -m launch.export --merge` writes it merged into a
plain model directory whose answers are the adapter's, and launch.serve's loader (launch.export.load_engine)
serves it."""
import json
import os
import shutil

import pytest
import torch

from actors import lora
from config import LoraConfig
from launch.eval import main as eval_main
from launch.export import SETTINGS_FILE, load_engine
from launch.export import main as export_main
from tests import tiny_export

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(LoRA export over tiny_export's model, that model, the BIRD dir): the adapter's B is small noise, so its
    answers differ from the base's somewhere while it still writes SQL."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_export")
    full, bird = tiny_export.build(root)
    torch.manual_seed(0)
    model = lora.inject(AutoModelForCausalLM.from_pretrained(full), LORA)
    tensors = [(k, torch.randn_like(p) * 0.5 if ".lora_B." in k else p.detach()) for k, p in lora.adapter_params(model).items()]
    adapter = lora.save_adapter(root / "hf_lora" / "step_1", tensors, LORA, str(full))
    for f in full.iterdir():  # the tokenizer and arctic_rl.json, as a LoRA run's export carries them
        if f.name.startswith(("tokenizer", "special_tokens", SETTINGS_FILE)):
            shutil.copy2(f, adapter / f.name)
    return adapter, full, bird


def _completions(out):
    return [json.loads(line)["completion"] for line in (out / "results.jsonl").read_text().splitlines()]


def test_eval_scores_a_lora_export_and_its_merge_answers_the_same(exports, tmp_path, capsys):
    adapter, full, bird = exports
    common = ["--bird-dir", str(bird), "--engine", "transformers", "--device", "cpu", "--workers", "1", "--timeout", "5"]
    assert eval_main(["--model", str(adapter), "--out-dir", str(tmp_path / "ev_lora"), *common]) == 0
    assert export_main(["--merge", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / SETTINGS_FILE).is_file()
    assert eval_main(["--model", str(tmp_path / "merged"), "--out-dir", str(tmp_path / "ev_merged"), *common]) == 0
    assert eval_main(["--model", str(full), "--out-dir", str(tmp_path / "ev_base"), *common]) == 0
    capsys.readouterr()
    lora_out, merged_out = _completions(tmp_path / "ev_lora"), _completions(tmp_path / "ev_merged")
    assert lora_out and lora_out == merged_out
    assert lora_out != _completions(tmp_path / "ev_base")  # the adapter is applied, not skipped


def test_merge_refuses_what_is_not_a_lora_export(exports, tmp_path, capsys):
    _, full, _ = exports
    assert export_main(["--merge", str(full), "--out", str(tmp_path / "m")]) == 2
    assert "not a LoRA export" in capsys.readouterr().err


def test_merge_as_typed_prints_only_its_line(exports, tmp_path):
    """`python -m launch.export --merge` in a fresh process: stdout is the `merged:` line and stderr carries no
    library WARNING (peft imports DeepSpeed, whose accelerator probe warns on a host without NVIDIA devices)."""
    import subprocess
    import sys

    adapter, _, _ = exports
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "launch.export", "--merge", str(adapter), "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == f"merged: {tmp_path / 'm'}", proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr and "accelerator" not in proc.stderr, proc.stderr


async def test_serve_loader_takes_a_lora_export(exports):
    adapter, _, _ = exports
    engine, tokenizer, settings = load_engine(adapter, "transformers", "cpu")
    assert settings["prompt_style"] == "compact" and engine._adapter  # the adapter is in the served model
    from queues.messages import PromptTask, pack_ids

    ids = tokenizer("SELECT")["input_ids"]
    group = await engine.generate(PromptTask(task_id="t", prompt_id="t", step=0, policy_version=0,
                                             prompt_tokens=pack_ids(ids), n=1))
    assert len(group.samples) == 1
