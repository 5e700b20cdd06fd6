"""vLLM's worker under LoRA, with a stand-in model (fake vLLM: no vLLM on CPU): a base tensor's load reaches
the layer vLLM's LoRA wrapper holds as `base_layer`, and the wrappers are back after the load.

The stand-in's `load_weights` resolves names the way vLLM's AutoWeightsLoader does, through the modules'
own parameter names, so a wrapped layer's `weight` (vLLM names it `<layer>.base_layer.weight`) is not found."""
from __future__ import annotations

import pytest
import torch

from actors.engines.vllm_worker import WeightLoaderExtension, lora_unwrapped


class FakeLoraWrapper(torch.nn.Module):
    """vLLM's BaseLayerWithLoRA in miniature: the original as `base_layer`, plus a LoRA delta."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, base.in_features))

    def set_lora(self, index, a, b):  # the marker vLLM's wrappers have
        self.lora_b.data.copy_(b)

    def forward(self, x):
        return self.base_layer(x) + x @ self.lora_b.T


class FakeModel(torch.nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"proj": torch.nn.Linear(2, 2, bias=False)})
                                           for _ in range(2)])
        self.head = torch.nn.Linear(2, 2, bias=False)
        if wrapped:
            for layer in self.layers:
                layer["proj"] = FakeLoraWrapper(layer["proj"])

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            if name not in params:
                raise ValueError(f"There is no module or parameter named {name!r}")
            params[name].data.copy_(t)
        return {n for n, _ in weights}


class FakeWorker(WeightLoaderExtension):
    def __init__(self, model):
        self.model_runner = type("Runner", (), {"model": model})()


def base_update():
    return [("layers.0.proj.weight", torch.full((2, 2), 3.0)), ("head.weight", torch.eye(2))]


def test_fake_vllm_a_wrapped_model_cannot_name_the_base_weight_without_unwrapping():
    with pytest.raises(ValueError, match="layers.0.proj.weight"):
        FakeModel(wrapped=True).load_weights(base_update())


def test_fake_vllm_arl_load_writes_the_base_under_lora_wrappers_and_the_wrappers_stay():
    model = FakeModel(wrapped=True)
    wrapper = model.layers[0]["proj"]
    wrapper.set_lora(0, None, torch.eye(2))
    FakeWorker(model).arl_load(base_update())
    assert model.layers[0]["proj"] is wrapper and isinstance(model.layers[1]["proj"], FakeLoraWrapper)
    assert torch.equal(wrapper.base_layer.weight, torch.full((2, 2), 3.0))
    assert torch.equal(model.head.weight, torch.eye(2))
    x = torch.ones(1, 2)
    assert torch.equal(wrapper(x), x @ torch.full((2, 2), 3.0).T + x)  # the adapter over the new base


def test_fake_vllm_the_wrappers_come_back_when_the_load_fails():
    model = FakeModel(wrapped=True)
    wrappers = [layer["proj"] for layer in model.layers]
    with pytest.raises(ValueError, match="nope"):
        FakeWorker(model).arl_load([("nope.weight", torch.zeros(2, 2))])
    assert [layer["proj"] for layer in model.layers] == wrappers


def test_without_lora_nothing_is_swapped():
    model = FakeModel(wrapped=False)
    with lora_unwrapped(model) as n:
        assert n == 0
    FakeWorker(model).arl_load(base_update())
    assert torch.equal(model.layers[0]["proj"].weight, torch.full((2, 2), 3.0))
