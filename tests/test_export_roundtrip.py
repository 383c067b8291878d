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


def test_an_export_replaces_a_link_in_its_place_and_leaves_the_link_target_alone(tmp_path):
    source = save_tiny_model("qwen2_5_vl", tmp_path / "src")
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    out = tmp_path / "safetensors" / "step_2"
    out.parent.mkdir()
    out.symlink_to(elsewhere, target_is_directory=True)  # a user linked a folder where the run exports
    out.with_name("step_2.tmp").symlink_to(elsewhere, target_is_directory=True)
    export_safetensors(model, str(source), out, dtype="float32")
    assert not out.is_symlink() and (out / "config.json").is_file()
    assert [p.name for p in elsewhere.iterdir()] == ["notes.txt"] and (elsewhere / "notes.txt").read_text() == "mine"
    assert not out.with_name("step_2.tmp").exists()
