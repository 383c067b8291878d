"""eval.model_name names the results folder; eval.limit caps questions per data set."""

from __future__ import annotations

import json

from physreason.config import load_config
from physreason.eval.launch import plan_eval


def _benchmark(root, n):
    folder = root / "toy"
    folder.mkdir(parents=True)
    entries = [{"video": f"clips/{i}.mp4", "qa_pairs": {"question": "q?", "index2ans": {"A": "x", "B": "y"}, "answer": "A"}}
               for i in range(n)]
    (folder / "toy_benchmark_qa_pairs.json").write_text(json.dumps(entries))


def test_limit_and_model_name(tmp_path):
    _benchmark(tmp_path / "bench", 5)
    cfg = load_config(None, [f"eval.benchmark_root={json.dumps(str(tmp_path / 'bench'))}", "eval.datasets=['toy']",
                             f"eval.results_dir={json.dumps(str(tmp_path / 'res'))}", "eval.limit=3",
                             "eval.model_name=my-sft-step100", "model.model_name_or_path=/ckpt/step_100",
                             # No checkpoint to read the family from: the style is named.
                             "prompt.style=reason1"])
    plan = plan_eval(cfg)
    assert len(plan.benchmarks[0].samples) == 3
    assert plan.base == tmp_path / "res" / "my-sft-step100" / "reasoning"
    unnamed = plan_eval(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"model_name": None, "limit": None})}))
    assert len(unnamed.benchmarks[0].samples) == 5
    assert unnamed.base.parent.name.endswith("step_100")
