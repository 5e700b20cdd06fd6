"""learner.lora in the config and the --dry-run plan: off by default, checked by name, resolved once (the
engines get the same adapter, keep the frozen base across sleeps, the sync goes through the object store), and
the memory plan gives the base no gradients or optimizer state."""
import pytest

from config import ConfigError, apply_overrides, to_dict, validate
from config.memory import GIB, lora_params, model_shape
from config.recipes import get_recipe
from launch.plan import make_plan


def resolved(recipe, *overrides):
    return validate(to_dict(apply_overrides(get_recipe(recipe), list(overrides))))


def test_lora_is_off_by_default_and_resolves_the_engines_side():
    assert resolved("tiny").learner.lora.rank == 0 and resolved("tiny").generator.lora.rank == 0
    cfg = resolved("tiny", "learner.lora.rank=8", "learner.lora.target_modules=q_proj,v_proj")
    assert cfg.generator.lora == cfg.learner.lora and cfg.generator.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.generator.sleep_level == 1 and cfg.coordinator.weight_sync == "object_store"
    gpu = resolved("bird_1p7b", "model.path=Qwen/Qwen3-1.7B", "learner.lora.rank=16")
    assert gpu.coordinator.weight_sync == "object_store"  # cuda_ipc without LoRA: the adapter alone is MiBs
    assert resolved("bird_1p7b", "model.path=Qwen/Qwen3-1.7B").coordinator.weight_sync == "cuda_ipc"


@pytest.mark.parametrize("override, key", [
    ("learner.lora.rank=-1", "learner.lora.rank"), ("learner.lora.alpha=0", "learner.lora.alpha"),
    ("learner.lora.dropout=1", "learner.lora.dropout"), ("learner.lora.target_modules=", "learner.lora.target_modules"),
    ("coordinator.weight_sync=nccl", "coordinator.weight_sync")])
def test_bad_lora_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolved("tiny", "learner.lora.rank=8", override)


def test_tiny_lora_is_tiny_with_an_adapter_and_the_same_warm_start():
    cfg, tiny = resolved("tiny_lora"), resolved("tiny")
    assert cfg.learner.lora.rank > 0 and cfg.model == tiny.model and cfg.data == tiny.data


def test_plan_gives_the_base_no_gradients_or_optimizer_state():
    full, with_lora = (make_plan(resolved("bird_32b", "model.path=Qwen/Qwen3-32B", *extra))
                       for extra in ((), ("learner.lora.rank=16",)))
    cfg = resolved("bird_32b", "model.path=Qwen/Qwen3-32B", "learner.lora.rank=16")
    shape = model_shape(cfg)
    adapter = lora_params(cfg, shape)
    # rank 16 on q,k,v,o,gate,up,down of 64 layers: 16 * (q 5120+8192, k,v 5120+1024, o 8192+5120, gate,up 5120+25600,
    # down 25600+5120) per layer
    assert adapter == 64 * 16 * (2 * 13312 + 2 * 6144 + 3 * 30720)
    assert with_lora.facts["LoRA adapter params"] == adapter
    assert with_lora.facts["weight sync per step (the adapter), MiB"] == pytest.approx(adapter * 2 / 2**20, abs=0.01)
    train = [g for g in with_lora.gpu_memory if "learner" in g.role][0].phases["training"]
    world = with_lora.learner_world_size
    assert train["learner grads"] == pytest.approx(2 * adapter / world / GIB)  # ZeRO-3: the adapter's, sharded
    assert train["learner optimizer"] == pytest.approx(12 * adapter / world / GIB)
    full_train = [g for g in full.gpu_memory if "learner" in g.role][0].phases["training"]
    assert train["learner optimizer"] < full_train["learner optimizer"] / 50
    assert any("LoRA rank 16" in n for n in with_lora.notes)
