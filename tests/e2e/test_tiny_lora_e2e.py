"""LoRA RL through the whole system (real Ray actors, Redis streams, DeepSpeed, the transformers engine): a
tiny run with `learner.lora.rank=4` moves the adapter's bytes alone in every step's weight sync, saves the warm
base it trained over the run's model directory, and ends with a PEFT adapter export over that base."""
import json

from actors import lora
from actors.learner.lora_base import BASE_MARKER
from config import layout
from tests.tiny_runs import run_tiny


def test_tiny_lora_run_syncs_the_adapter_alone_and_exports_an_adapter(tmp_path):
    rows = run_tiny(tmp_path, "lora", "learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=1e-3",
                    "coordinator.checkpoint_every=2", steps=2)
    run = tmp_path / "lora"
    ready = [json.loads(line) for line in (run / "logs" / "learner.jsonl").read_text().splitlines()]
    (trainable,) = [e["trainable_params"] for e in ready if e["event"] == "learner.ready"]
    synced = [r for r in rows if "weight_sync_bytes" in r]
    assert synced, rows  # at least one step trained and synced
    # fp32 adapter tensors, nothing else: the base never travels after the first sync (verl #7495's inverse)
    assert all(r["weight_sync_bytes"] == trainable * 4 for r in synced), ([r["weight_sync_bytes"] for r in synced], trainable)
    base = layout.model_dir(run)
    assert json.loads((base / BASE_MARKER).read_text())["base_steps"] == 20
    export = layout.export_dir(run, 2)
    assert lora.is_adapter_dir(export) and lora.base_model_of(export) == str(base.resolve())
