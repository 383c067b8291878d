"""vllm_compat.loads_in_place: may an engine whose layers post-process their weights (block FP8) take later pushes by a
copy into its live parameters? Checked against stand-ins for vLLM's LLM on CPU (no vLLM needed): the answer must come
from what a copy really does to the live tensors, and a refusal must leave vLLM's processed weights in place."""

from __future__ import annotations

import torch
from torch import nn

from physreason import vllm_compat


class _Model(nn.Module):
    """A live model as a worker holds it: `load_weights` copies checkpoint tensors in (as vLLM's loaders do), and
    `process` is its post-load processing (identity or a change of the loaded values)."""

    def __init__(self, process=lambda w: w, replace: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)
        self.register_buffer("scale", torch.ones(2))
        self.process, self.replace = process, replace

    def load_weights(self, weights):
        for name, tensor in weights:
            target = dict(self.named_parameters())[name] if name != "scale" else self.scale
            with torch.no_grad():
                if self.replace:  # a loader that registers new storage (CUDA graphs would read the old one)
                    self.linear.weight = nn.Parameter(tensor.clone(), requires_grad=False)
                else:
                    target.copy_(tensor)


class _LLM:
    """What loads_in_place uses of vllm.LLM: apply_model (one worker: a list of one result) and collective_rpc's
    reload_weights (load, then post-process)."""

    def __init__(self, model: _Model) -> None:
        self.model, self.reloads = model, 0

    def apply_model(self, fn):
        return [fn(self.model)]

    def collective_rpc(self, method, kwargs):
        """vLLM's reload: restages the layer (its own loader, not the processed model's), then post-processes."""
        assert method == "reload_weights"
        self.reloads += 1
        with torch.no_grad():
            for name, tensor in kwargs["weights_iterator"]:
                dict(self.model.named_parameters())[name].copy_(self.model.process(tensor))


def _setup(monkeypatch, model: _Model):
    monkeypatch.setattr(vllm_compat, "_one_cuda_worker_here", lambda llm: True)
    llm = _LLM(model)
    weights = [("linear.weight", torch.arange(16.0).reshape(4, 4))]
    llm.collective_rpc("reload_weights", {"weights_iterator": weights})  # the first push, vLLM's way
    return llm, weights


def test_pushes_copy_in_place_when_processing_leaves_the_loaded_tensors_as_they_are(monkeypatch):
    llm, weights = _setup(monkeypatch, _Model())
    address = llm.model.linear.weight.data_ptr()
    assert vllm_compat.loads_in_place(llm, weights) is True
    assert llm.reloads == 1  # nothing had to be restored
    vllm_compat.reload_weights(llm, [("linear.weight", torch.full((4, 4), 7.0))], in_place=True)
    assert llm.reloads == 1 and torch.equal(llm.model.linear.weight, torch.full((4, 4), 7.0))
    assert llm.model.linear.weight.data_ptr() == address


def test_processing_that_changes_the_values_keeps_vllms_path_and_its_processed_weights(monkeypatch):
    llm, weights = _setup(monkeypatch, _Model(process=lambda w: w.t().contiguous()))  # e.g. a transposed layout
    processed = llm.model.linear.weight.detach().clone()
    assert vllm_compat.loads_in_place(llm, weights) is False
    assert llm.reloads == 2  # the copy's result was replaced by vLLM's own again
    assert torch.equal(llm.model.linear.weight, processed)
    # the refusal says which tensor and how, for the engine's log and gpu-check's line
    reason = vllm_compat.in_place_refusal(llm, weights)
    assert reason == "linear.weight: 12 of 16 elements differ from vLLM's processed tensor (it is transposed)"
    assert llm.reloads == 3


def test_a_refusal_names_a_buffer_the_loader_rebuilt(monkeypatch):
    llm, weights = _setup(monkeypatch, _Model())

    def load(weights):
        llm.model.scale = torch.ones(2)  # a loader that registers a new tensor in place of the live one

    llm.model.load_weights = load
    reason = vllm_compat.in_place_refusal(llm, weights)
    assert reason == "scale: the loader put it in new storage (the captured CUDA graphs read the old one)"


def test_a_loader_that_moves_storage_or_fails_keeps_vllms_path(monkeypatch):
    llm, weights = _setup(monkeypatch, _Model(replace=True))
    assert vllm_compat.loads_in_place(llm, weights) is False  # same values, new storage: graphs would read stale memory

    llm, weights = _setup(monkeypatch, _Model())

    def broken(weights):
        raise KeyError("weight_scale_inv has no weight_loader once processed")

    llm.model.load_weights = broken
    assert vllm_compat.loads_in_place(llm, weights) is False
    assert "cannot take them once processed (KeyError" in vllm_compat.in_place_refusal(llm, weights)


def test_no_room_for_the_check_changes_nothing(monkeypatch):
    llm, weights = _setup(monkeypatch, _Model())
    before = llm.model.linear.weight.detach().clone()

    def out_of_memory(model):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(vllm_compat, "_snapshot", out_of_memory)
    assert vllm_compat.loads_in_place(llm, weights) is False
    assert llm.reloads == 1 and torch.equal(llm.model.linear.weight, before)


def test_not_tried_off_cuda_or_with_worker_processes(monkeypatch):
    monkeypatch.setattr(vllm_compat, "_one_cuda_worker_here", lambda llm: False)
    llm = _LLM(_Model())
    assert vllm_compat.loads_in_place(llm, [("linear.weight", torch.zeros(4, 4))]) is False
    assert llm.reloads == 0


def test_the_bitwise_check_sees_a_changed_buffer_and_an_fp8_tensor():
    model = _Model()
    before = vllm_compat._snapshot(model)
    assert vllm_compat._first_change(model, before) is None
    with torch.no_grad():
        model.scale[1] = 2.0
    assert vllm_compat._first_change(model, before) == "scale: 1 of 2 elements differ from vLLM's processed tensor"
    fp8 = nn.Module()
    fp8.register_buffer("weight", torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn))
    snap = vllm_compat._snapshot(fp8)
    assert vllm_compat._first_change(fp8, snap) is None
    fp8.weight.view(torch.uint8)[0] += 1
    assert vllm_compat._first_change(fp8, snap) == "weight: 1 of 2 elements differ from vLLM's processed tensor"
    reshaped = _Model()
    snap = vllm_compat._snapshot(reshaped)
    reshaped.scale.data = reshaped.scale.data.view(1, 2)  # same storage, another layout
    assert vllm_compat._first_change(reshaped, snap) == (
        "scale: loaded as torch.float32 [1, 2], processed by vLLM as torch.float32 [2]"
    )
