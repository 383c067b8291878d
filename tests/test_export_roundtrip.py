"""Export: the safetensors folder loads in transformers as is and gives the trained model's logits."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from physreason.models.export import export_safetensors
from physreason.models.tiny import save_tiny_model


def test_exported_folder_reloads_with_identical_logits(tmp_path, vl_kind):
    source = save_tiny_model(vl_kind, tmp_path / "src")
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # a "trained" change the export must carry
    out = export_safetensors(model, str(source), tmp_path / "export", dtype="float32")
    reloaded = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    names = ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "generation_config.json")
    for name in (*names, "video_preprocessor_config.json"):
        assert (out / name).is_file()
    assert AutoTokenizer.from_pretrained(out).chat_template
    assert json.loads((out / "config.json").read_text())["model_type"] == vl_kind
    assert not (tmp_path / "export.tmp").exists()
