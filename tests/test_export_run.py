"""physreason export: any checkpoint of a run (full or LoRA) as a folder transformers loads and new runs start from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import grpo_recipe, sft_recipe, write_chat_records, write_mcq_file

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.train.export_run import EXPORT_MANIFEST, export_run, is_export
from physreason.train.sft import run_sft

REPO = Path(__file__).resolve().parents[1]


def sft_config(model: Path, data: Path, out: Path, *extra: str):
    # float32 exports: the run's own export and `physreason export` are compared bit for bit
    return sft_recipe(model, data, out, "model.dtype='float32'", *extra, lr="2e-3", logger="['jsonl']")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A 4-step SFT run saving (and exporting) steps 2 and 4, then cut short in the save of step 5."""
    folder = tmp_path_factory.mktemp("full_run")
    data = write_chat_records(folder, 4)
    run = folder / "run"
    run_sft(sft_config(tiny_model_dir, data, run, "train.max_steps=4", "train.ckpt.save_freq=2", "train.ckpt.max_keep=2"))
    (run / "checkpoints" / "step_5.tmp").mkdir()  # a save a kill cut short: never a checkpoint
    return run


def same_weights(a: Path, b: Path) -> bool:
    got, want = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)


def test_the_latest_complete_checkpoint_exports_as_a_folder_transformers_loads_unchanged(full_run, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    out = export_run(full_run, tmp_path / "export")
    assert same_weights(out, full_run / "safetensors" / "step_4")  # step 4, not the unfinished step_5.tmp
    model, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    # (the video processor needs torchvision, which CPU torch lacks: its config file is checked below)
    assert AutoTokenizer.from_pretrained(out).chat_template and AutoImageProcessor.from_pretrained(out) is not None
    assert GenerationConfig.from_pretrained(out).eos_token_id is not None
    for name in ("chat_template.jinja", "generation_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    older = export_run(full_run, tmp_path / "step2", step=2)
    assert same_weights(older, full_run / "safetensors" / "step_2") and not same_weights(older, out)


def test_export_mistakes_are_one_clear_error_before_anything_is_written(full_run, tmp_path):
    with pytest.raises(ConfigError, match=r"no complete checkpoint of step 5; available steps: 2, 4"):
        export_run(full_run, tmp_path / "a", step=5)
    with pytest.raises(ConfigError, match="trained the full model"):
        export_run(full_run, tmp_path / "b", adapter_only=True)
    with pytest.raises(ConfigError, match=r"--dtype 'fp8' is not one of bfloat16, float16, float32, auto"):
        export_run(full_run, tmp_path / "c", dtype="fp8")
    with pytest.raises(ConfigError, match="holds no config.toml"):
        export_run(tmp_path, tmp_path / "d")
    with pytest.raises(ConfigError, match=r"^--out /: give a folder of its own to write the model into \(e.g. /exported\)$"):
        export_run(full_run, "/", force=True)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for force in (False, True):  # a folder physreason export did not write is never replaced
        with pytest.raises(ConfigError, match=f"--out {taken} is not empty and is not an earlier output .*"
                                              f"{EXPORT_MANIFEST}"):  # fmt: skip
            export_run(full_run, taken, force=force)
    assert (taken / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    # inside the run's checkpoints/ or safetensors/: the run's later saves would replace or rotate the export away
    for area, step in (("checkpoints", "step_6"), ("safetensors", "step_6"), ("checkpoints", "step_4"),
                       ("safetensors", "step_4"), ("safetensors", "")):  # fmt: skip
        existed = (full_run / area / step).exists()
        for force in (False, True):
            with pytest.raises(ConfigError, match=f"lies inside the run's {area} folder: write the export elsewhere"):
                export_run(full_run, full_run / area / step, force=force)
        assert (full_run / area / step).exists() == existed
    assert not [p for p in full_run.rglob("*.lock") if p.name != ".physreason.lock"]  # the run's own lock only
    # a folder holding only the lock file an earlier export left beside its --out counts as empty
    failed = tmp_path / "parent"
    failed.mkdir()
    (failed / ".exported.lock").write_text("pid 1")
    assert is_export(export_run(full_run, failed))
    earlier = export_run(full_run, tmp_path / "earlier", step=2)
    assert is_export(earlier) and json.loads((earlier / EXPORT_MANIFEST).read_text())["checkpoint"] == "step_2"
    with pytest.raises(ConfigError, match="holds an earlier physreason export: pass --overwrite"):
        export_run(full_run, earlier)
    export_run(full_run, earlier, force=True, dtype="bfloat16")  # an earlier export is replaced
    assert {t.dtype for t in load_file(earlier / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((earlier / EXPORT_MANIFEST).read_text())["checkpoint"] == "step_4"


def test_an_out_given_as_dot_is_the_current_folder_with_its_staging_folder_beside_it(full_run, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert export_run(full_run, ".") == here and is_export(here)  # an empty current folder: exported into it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".here.lock", "here"]  # no staging folder left beside it
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    with pytest.raises(ConfigError, match=f"--out {tmp_path} is not empty and is not an earlier output"):
        export_run(full_run, "..", force=True)


def test_force_never_replaces_the_run_a_folder_holding_it_or_one_of_its_folders(full_run, tmp_path):
    before = sorted(str(p.relative_to(full_run.parent)) for p in full_run.parent.rglob("*"))
    for out, why in [(full_run, "is the run being exported"), (full_run.parent, f"holds {full_run}: the run"),
                     (full_run / "logs", "is not empty and is not an earlier output"),
                     (full_run / "safetensors" / "step_4", "lies inside the run's safetensors folder")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"--out {out} {why}"):
            export_run(full_run, out, force=True)
    model = Path(load_config(full_run / "config.toml").model.model_name_or_path)
    with pytest.raises(ConfigError, match=f"--out {model} is the model the run trained from"):
        export_run(full_run, model, force=True)
    assert (model / "config.json").is_file()
    assert sorted(str(p.relative_to(full_run.parent)) for p in full_run.parent.rglob("*")) == before
    # a folder in the way of the staging folder (<out>.tmp) is not removed either
    (tmp_path / "new.tmp").mkdir()
    (tmp_path / "new.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"staging folder of --out .*new, .*new.tmp is not empty"):
        export_run(full_run, tmp_path / "new")
    assert (tmp_path / "new.tmp" / "notes.txt").read_text() == "mine"


def test_a_folder_named_like_the_old_export_set_aside_is_never_deleted_even_the_run_being_exported(full_run, tmp_path):
    import shutil

    mine = tmp_path / ".exported.old"  # a name a replaced export could be set aside under
    mine.mkdir()
    (mine / "notes.txt").write_text("backup")
    out = export_run(full_run, tmp_path / "exported", step=2)
    assert (mine / "notes.txt").read_text() == "backup"
    export_run(full_run, out, force=True)  # the earlier export is set aside under a name of this call's own
    assert (mine / "notes.txt").read_text() == "backup"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".exported.lock", ".exported.old", "exported"]
    assert same_weights(out, full_run / "safetensors" / "step_4")
    run = tmp_path / ".r.old"
    shutil.copytree(full_run, run)
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert same_weights(export_run(run, tmp_path / "r", trust=True), full_run / "safetensors" / "step_4")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == files


def test_an_export_in_the_way_of_the_staging_folder_is_replaced_only_with_overwrite(full_run, tmp_path):
    earlier = export_run(full_run, tmp_path / "new.tmp", step=2)  # a finished export under the staging folder's name
    with pytest.raises(ConfigError, match=f"staging folder of --out {tmp_path / 'new'}, {earlier}, holds a physreason "
                                          "export .*: pass --overwrite to replace it, or move it away"):  # fmt: skip
        export_run(full_run, tmp_path / "new")
    assert is_export(earlier) and same_weights(earlier, full_run / "safetensors" / "step_2")
    assert same_weights(export_run(full_run, tmp_path / "new", force=True), full_run / "safetensors" / "step_4")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["new"]


def test_a_checkpoint_copied_into_a_run_is_exported_only_when_trusted(full_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(full_run, run)  # new inodes: not the folders the run recorded in written.json
    with pytest.raises(ConfigError, match="unpickles its .metadata"):
        export_run(run, tmp_path / "out")
    assert same_weights(export_run(run, tmp_path / "out", trust=True), full_run / "safetensors" / "step_4")


def test_the_cli_writes_the_folder_and_answers_a_wrong_step_with_exit_2_and_one_line(full_run, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "physreason", "export", str(full_run), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"wrote the Hugging Face model to {tmp_path / 'out'}" in done.stdout
    wrong = subprocess.run([*command, "--step", "3", "--force"], capture_output=True, text=True, env=env, timeout=300)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [f"error: {full_run} has no complete checkpoint of step 3; available "
                                                 "steps: 2, 4"]  # fmt: skip


def test_the_cli_refuses_to_replace_the_run_its_parent_or_another_folder_and_replaces_an_earlier_export(full_run,
                                                                                                         tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def export(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "physreason", "export", str(full_run), *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("mine")
    before = sorted(map(str, full_run.parent.rglob("*")))
    for out, why in [(full_run, "is the run being exported"), (full_run.parent, f"holds {full_run}: the run"),
                     (unrelated, "is not empty and is not an earlier output")]:  # fmt: skip
        refused = export("--out", str(out), "--force")
        assert refused.returncode == 2, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith(f"error: --out {out} {why}"), line
    assert sorted(map(str, full_run.parent.rglob("*"))) == before  # nothing of the run deleted
    assert (unrelated / "todo.txt").read_text() == "mine"
    out = tmp_path / "exported"
    first = export("--out", str(out), "--step", "2")
    assert first.returncode == 0, first.stderr
    again = export("--out", str(out), "--force")  # the old name of --overwrite
    assert again.returncode == 0, again.stderr
    assert json.loads((out / EXPORT_MANIFEST).read_text())["checkpoint"] == "step_4"
    assert same_weights(out, full_run / "safetensors" / "step_4")


def test_an_out_that_is_a_link_is_refused_with_exit_2_and_its_target_left_alone(full_run, tmp_path):
    earlier = export_run(full_run, tmp_path / "earlier", step=2)
    before = {p.name: p.read_bytes() for p in earlier.iterdir() if p.is_file()}
    link = full_run / "safetensors" / "step_9"  # a user linked an export into the run
    link.symlink_to(earlier, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        with pytest.raises(ConfigError, match=f"--out {link}: {link} is a symbolic link \\(to {earlier}\\)"):
            export_run(full_run, link, force=True)
        command = [sys.executable, "-m", "physreason", "export", str(full_run), "--out", str(link), "--overwrite"]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"error: --out {link}: {link} is a symbolic link") and "give the folder" in line, line
        assert link.is_symlink() and link.readlink() == earlier
    finally:
        link.unlink()
    assert {p.name: p.read_bytes() for p in earlier.iterdir() if p.is_file()} == before
    staged = tmp_path / "new.tmp"  # a link in the way of the staging folder: never written through
    staged.symlink_to(earlier, target_is_directory=True)
    with pytest.raises(ConfigError, match=f"--out {tmp_path / 'new'}: {staged} is a symbolic link"):
        export_run(full_run, tmp_path / "new")
    assert {p.name: p.read_bytes() for p in earlier.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_a_lora_checkpoint_exports_merged_or_as_its_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    data = write_chat_records(tmp_path, 4)
    run = tmp_path / "run"
    run_sft(sft_config(tiny_model_dir, data, run, "train.max_steps=2", "train.ckpt.save_freq=2", "train.lora.enable=true",
                       "train.lora.rank=8", "train.lora.alpha=16", "train.optm_lr=1e-2"))  # fmt: skip
    own = run / "safetensors" / "step_2"
    merged = export_run(run, tmp_path / "merged")
    assert same_weights(merged, own)
    _, info = AutoModelForImageTextToText.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info
    adapter = export_run(run, tmp_path / "adapter", adapter_only=True)
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                         EXPORT_MANIFEST]  # fmt: skip
    got, want = load_file(adapter / "adapter_model.safetensors"), load_file(own / "adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.slow
def test_sft_starts_from_an_exported_folder_with_the_trained_weights(full_run, tiny_model_dir, tmp_path):
    out = export_run(full_run, tmp_path / "export", dtype="float32")
    data = full_run.parent / "train.jsonl"
    first = dict(overrides=("train.max_steps=1", "train.ckpt.enable_checkpoint=false"))
    from_export = run_sft(sft_config(out, data, tmp_path / "from_export", *first["overrides"]))
    from_base = run_sft(sft_config(tiny_model_dir, data, tmp_path / "from_base", *first["overrides"]))
    # The same first batch: the model trained on these records for 4 steps fits it better than the base model.
    assert from_export.losses[0] < from_base.losses[0]


@pytest.mark.slow
def test_grpo_exports_and_starts_from_an_exported_folder(tiny_text, tmp_path):
    from physreason.train.grpo import run_grpo

    data = write_mcq_file(tmp_path)

    def config(model: Path, out: str, *extra: str):
        return grpo_recipe(model, data, tmp_path / out, "train.gradient_checkpointing=false",
                           "train.ckpt.export_safetensors=false", "logging.logger=['jsonl']", *extra, lr="2e-2")  # fmt: skip

    run_grpo(config(tiny_text, "run", "train.max_steps=2", "train.ckpt.save_freq=2"))
    out = export_run(tmp_path / "run", tmp_path / "export", dtype="float32")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    started = run_grpo(config(out, "from_export", "train.max_steps=1", "train.ckpt.enable_checkpoint=false"))
    # The rollout engine and the policy both loaded the export: their log-probs agree before any update.
    assert started.metrics[0]["rollout/logprob_mismatch"] < 1e-4
    trained = load_file(out / "model.safetensors")
    base = load_file(tiny_text / "model.safetensors")
    assert any(not trained[k].equal(base[k].to(trained[k].dtype)) for k in base)  # the export holds trained weights


@pytest.mark.vllm
def test_vllm_serves_an_exported_checkpoint_as_transformers_does(full_run, tmp_path):
    pytest.importorskip("vllm")
    from physreason.config import EngineConfig, ModelConfig, SamplingConfig
    from physreason.engines.base import GenerationRequest
    from physreason.engines.hf import HFEngine
    from physreason.engines.vllm import VLLMEngine

    out = export_run(full_run, tmp_path / "export")  # float32, the run's model.dtype
    model = ModelConfig(model_name_or_path=str(out), dtype="float32", model_max_length=2048)
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=10)
    requests = [GenerationRequest(messages=[{"role": "user", "content": "Does the box slide?"}], request_id="a")]

    def tokens(results) -> list[list[int]]:
        assert all(r.error is None for r in results), [r.error for r in results]
        return [r.completions[0].token_ids for r in results]

    want = tokens(HFEngine(model, EngineConfig()).generate(requests, greedy))
    assert tokens(VLLMEngine(model, EngineConfig(enforce_eager=True)).generate(requests, greedy)) == want


def test_a_second_export_into_the_same_out_is_refused_while_the_first_writes(full_run, tmp_path):
    import shutil

    from setups import lock_holder

    from physreason.train import runlock

    out = tmp_path / "exported"
    holder = lock_holder(tmp_path / ".exported.lock")
    try:
        with pytest.raises(ConfigError, match=rf"--out {out} is in use by another run \(pid {holder.pid} on "):
            export_run(full_run, out)
        assert not out.exists() and not (tmp_path / "exported.tmp").exists()
        # the first export has begun writing its staging folder (its manifest first): still "in use", not --overwrite
        staging = export_run(full_run, tmp_path / "elsewhere").rename(tmp_path / "exported.tmp")
        with pytest.raises(ConfigError, match=rf"--out {out} is in use by another run \(pid {holder.pid} on "):
            export_run(full_run, out)
        shutil.rmtree(staging)
    finally:
        holder.kill()
        holder.wait()
    assert not runlock._HELD
    assert is_export(export_run(full_run, out))  # the lock's holder gone: the export runs
