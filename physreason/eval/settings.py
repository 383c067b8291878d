"""How an evaluation asks its questions, resolved once: prompt style and mode, answer type, sampling, and the
settings a reproduction of its scores needs (written into each run's run.json and every report's header).

One source per setting: the reasoning mode is prompt.reasoning; eval.answer_type ("reasoning" | "letter", the
results folder's name) follows it when unset, and sets it when prompt.reasoning is unset; the two set to different
modes is a ConfigError naming both. Seeds: each repeat's seed is eval.seed + k and replaces generation.seed, the
style's default seed included (Cosmos-Reason2's 1234 / 3407), so repeats differ; the header lists the seeds used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from physreason import __version__
from physreason.chat.style import Prompting, build_mcq_messages, resolve_prompting, resolve_sampling
from physreason.config import Config, SamplingConfig
from physreason.errors import ConfigError
from physreason.models.source import folder_content_hash

AnswerMode = Literal["reasoning", "letter"]
# The sampling keys a reproduction needs, in the order reports show them.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)


@dataclass(frozen=True)
class EvalSetup:
    """The resolved prompt style and mode, the answer type naming the results folder, and the generation settings."""

    prompting: Prompting
    sampling: SamplingConfig  # generation settings before each repeat's seed replaces `seed`
    answer_type: AnswerMode


def resolve_eval_setup(cfg: Config) -> EvalSetup:
    """The recipe's prompt style, mode and sampling for its checkpoint; raises ConfigError on a mode conflict.

    Reads the checkpoint's config.json when prompt.style is 'auto' (physreason.models.inputs.prompting_for).
    """
    from physreason.models.inputs import prompting_for

    answer_type, reasoning = cfg.eval.answer_type, cfg.prompt.reasoning
    if answer_type is not None and reasoning is not None and (answer_type == "reasoning") != reasoning:
        raise ConfigError(
            f"eval.answer_type = {answer_type!r} but prompt.reasoning = {str(reasoning).lower()}: they are one "
            "setting (the reasoning mode); set only prompt.reasoning (--reasoning/--no-reasoning), and "
            "eval.answer_type follows it"
        )
    if answer_type is not None and reasoning is None:
        cfg = cfg.model_copy(update={"prompt": cfg.prompt.model_copy(update={"reasoning": answer_type == "reasoning"})})
    if cfg.prompt.style != "auto":  # the family is not needed, so an unreadable checkpoint is no error here
        prompting = resolve_prompting(cfg, "")
        return EvalSetup(prompting, resolve_sampling(cfg, prompting), "reasoning" if prompting.reasoning else "letter")
    try:
        prompting, sampling = prompting_for(cfg)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.model_name_or_path = {cfg.model.model_name_or_path!r}: its config.json cannot be read to choose "
            f"the prompt style ({exc}); give a local model folder or a hub id, or set prompt.style"
        ) from exc
    return EvalSetup(prompting, sampling, "reasoning" if prompting.reasoning else "letter")


def effective_config(cfg: Config) -> tuple[Config, EvalSetup]:
    """The config with its prompt style, mode, answer type and generation settings resolved, and the setup.

    This is the config an evaluation stores beside its results: its shard processes read it back and resolve
    to the same setup (every value is then explicit), and a resumed run compares its settings against it.
    """
    setup = resolve_eval_setup(cfg)
    prompt = cfg.prompt.model_copy(update={"style": setup.prompting.style, "reasoning": setup.prompting.reasoning})
    resolved = cfg.model_copy(
        update={
            "prompt": prompt,
            "generation": setup.sampling,
            "eval": cfg.eval.model_copy(update={"answer_type": setup.answer_type}),
        }
    )
    return resolved, setup


def model_commit(model_name_or_path: str, revision: str | None) -> str | None:
    """The commit of a Hub model's cached snapshot (read offline from the cache's folder name); None otherwise."""
    if Path(model_name_or_path).expanduser().is_dir():
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_name_or_path, "config.json", revision=revision)
    except ValueError:  # not a valid repository id
        return None
    if not isinstance(cached, str):
        return None
    parts = Path(cached).parts
    return parts[-2] if len(parts) >= 3 and parts[-3] == "snapshots" else None


def model_fingerprint(folder: str | Path, *, every_file: bool = False) -> str:
    """A short content hash of a local model folder (12 hex digits): which weights a result was made with
    (models.source.folder_content_hash; `every_file`: as results recorded it before 2026-11-29)."""
    return folder_content_hash(folder, every_file=every_file)


def legacy_fingerprint(cfg: Config) -> str | None:
    """The content hash of `cfg.model`'s local folder as results recorded before 2026-11-29 (every file), None for a
    Hub id: a run.json holding it was made with these weights too."""
    local = Path(cfg.model.model_name_or_path).expanduser()
    return model_fingerprint(local, every_file=True) if local.is_dir() else None


# The run.json keys that say which weights a run's results were made with; model_identity gives them.
MODEL_IDENTITY = ("model_commit", "model_fingerprint")


def model_identity(cfg: Config) -> dict[str, str | None]:
    """Which weights `cfg.model` names now: a Hub snapshot's commit and a local folder's content hash (None where
    unknown or not applicable). Two models saved one after another at the same path differ here, not in their path."""
    local = Path(cfg.model.model_name_or_path).expanduser()
    return {
        "model_commit": model_commit(cfg.model.model_name_or_path, cfg.model.revision),
        "model_fingerprint": model_fingerprint(local) if local.is_dir() else None,
    }


def system_prompt_text(prompting: Prompting, answer_type: AnswerMode) -> str:
    """The system prompt a multiple-choice question of this evaluation is asked with ('' for none): the recipe's
    prompt.system_prompt, else the style's own (Reason1's benchmark 'Answer the questions.', Reason2's default)."""
    from physreason.eval.runner import _with_system_prompt

    messages = build_mcq_messages("?", {"A": "a", "B": "b"}, answer_type=answer_type, style=prompting.style)
    if prompting.system_prompt is not None:
        messages = _with_system_prompt(messages, prompting.system_prompt, prompting.style)
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    return system if isinstance(system, str) else ""


def reproduction_settings(cfg: Config, setup: EvalSetup) -> dict[str, Any]:
    """What a reproduction of an evaluation needs, JSON-ready: model and revision, prompt, vision, sampling, version.

    Pixel budgets are the resolved ones (the token defaults times the checkpoint's patch factor squared);
    per-repeat seeds are added by the caller.
    """
    from physreason.models.inputs import patch_factor
    from physreason.vision.resize import pixel_budgets

    factor = patch_factor(cfg.model.model_name_or_path, cfg.model.revision)
    budgets = pixel_budgets(cfg.vision, factor)
    local = Path(cfg.model.model_name_or_path).expanduser()
    return {
        "physreason_version": __version__,
        "model": str(local.resolve()) if local.is_dir() else cfg.model.model_name_or_path,
        "model_revision": cfg.model.revision,
        **model_identity(cfg),
        "engine": cfg.engine.backend,
        "prompt_style": setup.prompting.style,
        "reasoning": setup.prompting.reasoning,
        "system_prompt": setup.prompting.system_prompt,
        "system_prompt_used": system_prompt_text(setup.prompting, setup.answer_type),
        "fps": cfg.vision.fps,
        "nframes": cfg.vision.nframes,
        "min_frames": cfg.vision.min_frames,
        "max_frames": cfg.vision.max_frames,
        "min_pixels": budgets.min_pixels,
        "max_pixels": budgets.max_pixels,
        "total_pixels": budgets.total_pixels,
        "patch_factor": factor,
        "timestamps": cfg.vision.timestamps,
        **{key: getattr(setup.sampling, key) for key in SAMPLING_KEYS},
        "seed_rule": "eval.seed + repeat (replaces generation.seed)",
    }
