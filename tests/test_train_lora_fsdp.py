"""LoRA under FSDP2: two gloo processes train the adapters to the same losses and exports as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model
from physreason.train.sft import run_sft

pytest.importorskip("peft")
pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run

ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from physreason.config import load_config
    from physreason.train.sft import run_sft
    result = run_sft(load_config(None, json.loads(sys.argv[1])))
    if dist.get_rank() == 0:
        json.dump(result.losses, open(sys.argv[2], "w"))
    dist.destroy_process_group()
    """
)


def _overrides(model: Path, data: Path, out: Path) -> list[str]:
    return [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        "train.train_batch_per_replica=4", "train.mini_batch=1", "train.max_steps=3", "train.optm_lr=1e-2",
        "train.param_dtype='float32'", "data.num_workers=0", "logging.logger=['jsonl']", "model.dtype='float32'",
        "train.ckpt.save_freq=3", "train.ckpt.export_safetensors=true", "train.ckpt.max_keep=1",
        "train.lora.enable=true", "train.lora.rank=4", "train.lora.vision=true",
    ]


@pytest.mark.slow
def test_two_gloo_processes_train_lora_like_one_process(tmp_path):
    model = save_tiny_model("qwen2_5_vl", tmp_path / "model")
    records = [{"conversations": [{"role": "user", "content": f"Does it roll {i}?"}, {"role": "assistant", "content": ANSWER}]}
               for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    single = run_sft(load_config(None, _overrides(model, data, tmp_path / "one")))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    losses_file = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
               str(script), json.dumps(_overrides(model, data, tmp_path / "two")), str(losses_file)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads(losses_file.read_text())
    assert len(two) == 3 and two[-1] < two[0]
    assert torch.allclose(torch.tensor(two), torch.tensor(single.losses), rtol=1e-4, atol=1e-5)
    for part in ("model.safetensors", "adapter/adapter_model.safetensors"):
        one_weights = load_file(tmp_path / "one" / "safetensors" / "step_3" / part)
        two_weights = load_file(tmp_path / "two" / "safetensors" / "step_3" / part)
        assert one_weights.keys() == two_weights.keys()
        for name, tensor in one_weights.items():
            assert torch.allclose(tensor, two_weights[name], atol=1e-4), (part, name)
