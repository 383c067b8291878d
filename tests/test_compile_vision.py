"""train.compile_vision: the vision encoder's blocks compiled in a real SFT run on image records (both families),
the same losses as the eager tower; a model without a vision encoder refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from media import write_image
from setups import ANSWER, sft_recipe

from physreason.errors import ConfigError
from physreason.train.sft import run_sft


def _image_records(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(4):
        write_image(folder / f"img{i}.png", seed=i)
        records.append({"image": f"img{i}.png", "conversations": [
            {"role": "user", "content": f"Does it roll {i}?"}, {"role": "assistant", "content": ANSWER}]})  # fmt: skip
    data = folder / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    return data


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_vision_blocks_train_as_the_eager_tower_does(vl_model_dir, tmp_path):
    from torch._dynamo.utils import counters

    data = _image_records(tmp_path / "data")

    def losses(name: str, *settings: str) -> list[float]:
        recipe = sft_recipe(vl_model_dir, data, tmp_path / name, "train.max_steps=2",
                            "train.ckpt.enable_checkpoint=false", *settings, lr="1e-3", logger="['jsonl']")  # fmt: skip
        return run_sft(recipe).losses

    eager = losses("eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = losses("compiled", "train.compile_vision=true")  # the decoder stays eager: every graph is the tower's
    assert counters["stats"]["unique_graphs"] >= 1
    reasons = " ".join(counters["graph_break"])
    assert "HOP" not in reasons and "checkpoint" not in reasons, reasons  # traced under recompute, not run eagerly
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)


def test_compile_vision_on_a_model_without_a_vision_encoder_is_refused():
    from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
    from physreason.train.build import compile_blocks

    model = build_tiny_model("qwen2", build_tiny_tokenizer())
    with pytest.raises(ConfigError, match=r"^train.compile_vision = true, but \w+ has no vision encoder: set "
                       r"train.compile_vision = false$"):  # fmt: skip
        compile_blocks(model, decoder=False, vision=True)
    assert all(block._compiled_call_impl is None for block in model.model.layers)  # refused before compiling any
