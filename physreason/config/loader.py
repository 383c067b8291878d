"""Read a TOML recipe, apply `--set a.b=value` overrides, validate, and explain every error."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from physreason.config.schema import Config
from physreason.errors import ConfigError
from physreason.files import write_atomic

# cosmos-rl keys whose meaning lives under another name here; named in the error so a ported
# recipe is fixed in one edit.
MOVED_KEYS: dict[str, str] = {
    "policy.model_name_or_path": "model.model_name_or_path",
    "policy.model_max_length": "model.model_max_length",
    "policy.model_gradient_checkpointing": "train.gradient_checkpointing",
    "train.train_policy.temperature": "rollout.sampling_config.temperature (one temperature serves rollout and policy)",
    "train.train_policy.epsilon_low": "grpo.epsilon_low",
    "train.train_policy.epsilon_high": "grpo.epsilon_high",
    "train.train_policy.kl_beta": "grpo.kl_beta",
    "train.train_policy.mu_iterations": "grpo.mu_iterations",
    "train.train_policy.reward_function": "grpo.reward_function",
    "train.train_policy.mini_batch": "train.mini_batch",
    "train.train_policy.dataset": "data.dataset",
    "train.train_policy": "the [grpo] and [data] sections",
    # One source per setting: GRPO sizes its rollouts from these [rollout] keys.
    "rollout.sampling_config.max_tokens": "rollout.max_response_length (the one completion-length setting of GRPO)",
    "rollout.sampling_config.n": "rollout.n_generation (the one group-size setting of GRPO)",
}


# Well-known names from TRL / Hugging Face TrainingArguments / vLLM for keys that have another name here: an
# unknown key with one of these names is answered with the key to use, in whichever section it was written.
FAMILIAR_NAMES: dict[str, str] = {
    "learning_rate": "train.optm_lr",
    "lr": "train.optm_lr",
    "weight_decay": "train.optm_weight_decay",
    "max_grad_norm": "train.optm_grad_norm_clip",
    "warmup_steps": "train.optm_warmup_steps",
    "lr_scheduler_type": "train.optm_decay_type",
    "optim": "train.optm_name",
    "num_train_epochs": "train.epoch",
    "epochs": "train.epoch",
    "per_device_train_batch_size": "train.mini_batch (samples per forward; train.train_batch_per_replica per step)",
    "gradient_accumulation_steps": "train.train_batch_per_replica / train.mini_batch (the accumulation follows)",
    "logging_steps": "train.log_freq",
    "save_steps": "train.ckpt.save_freq",
    "save_total_limit": "train.ckpt.max_keep",
    "eval_steps": "train.validation_freq",
    "resume_from_checkpoint": "train.resume",
    "model_name": "model.model_name_or_path",
    "model": "model.model_name_or_path",
    "max_length": "model.model_max_length",
    "max_seq_length": "model.model_max_length",
    "num_generations": "rollout.n_generation",
    "max_completion_length": "rollout.max_response_length",
    "beta": "grpo.kl_beta",
    "epsilon": "grpo.epsilon_low / grpo.epsilon_high",
    "tp_size": "engine.tensor_parallel_size (eval: eval.tp_size)",
    "tp": "engine.tensor_parallel_size",
    "max_new_tokens": "generation.max_tokens",
}


# Deepest nesting of lists and tables a value may have: settings go three deep at most, and Python's TOML and JSON
# readers (recursive) raise RecursionError on a few hundred levels.
MAX_NESTING = 32
# Longest text of a value quoted in an error message; longer ones are cut, so an error stays one readable line.
SHOWN_CHARS = 60


def _shown(text: str) -> str:
    """`text` as an error message quotes it: whole when short, else its start and its length."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def _nesting(value: Any) -> int:
    """How deep lists and tables nest in `value` (a plain value is 0), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _too_deep_key(tree: Mapping[str, Any], prefix: str = "") -> str | None:
    """The dotted key of the first value in a recipe tree nested deeper than MAX_NESTING, or None."""
    stack = [(f"{prefix}{key}", value, 1) for key, value in tree.items()]
    while stack:
        key, value, depth = stack.pop()
        if isinstance(value, dict) and depth < MAX_NESTING:
            stack.extend((f"{key}.{name}", child, depth + 1) for name, child in value.items())
        elif depth + _nesting(value) > MAX_NESTING + 1:
            return key
    return None


def _parse_problem(exc: Exception) -> str:
    """Why Python's TOML or JSON reader gave up on a value that is not a syntax error."""
    if isinstance(exc, RecursionError):
        return f"lists or tables nested more than {MAX_NESTING} deep, deeper than any setting"
    if "digits" in str(exc):
        return f"a number of more than {sys.get_int_max_str_digits()} digits, larger than any setting takes"
    return f"a value Python cannot read ({_shown(str(exc))})"


def _long_number_line(text: str) -> str:
    """" at line N" of the first integer too long for Python's readers in `text`, or ""."""
    found = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    return f" at line {text.count(chr(10), 0, found.start()) + 1}" if found else ""


def _deep_line(text: str) -> str:
    """" at line N" of the TOML text where lists or tables first nest more than MAX_NESTING deep, or "" (strings and
    comments are skipped roughly: enough to point at the line)."""
    depth = 0
    for number, line in enumerate(text.splitlines(), start=1):
        quote = None
        for char in line:
            if quote:
                quote = None if char == quote else quote
            elif char in "\"'":
                quote = char
            elif char == "#":
                break
            elif char in "[{":
                depth += 1
                if depth > MAX_NESTING:
                    return f" at line {number}"
            elif char in "]}":
                depth = max(depth - 1, 0)
    return ""


def _suggestion(key_path: tuple[str | int, ...], allowed: list[str] | None) -> str:
    """'did you mean ...' for an unknown key: a well-known name's key here, else the closest allowed keys."""
    import difflib

    name = str(key_path[-1])
    if name in FAMILIAR_NAMES:
        return f"did you mean {FAMILIAR_NAMES[name]}?"
    close = difflib.get_close_matches(name, allowed or [], n=3, cutoff=0.6)
    if not close:
        # optm_lr for learning_rate style names: compare with the prefix-free part of each key too
        stripped = {key.split("_", 1)[-1]: key for key in allowed or [] if "_" in key}
        close = [stripped[m] for m in difflib.get_close_matches(name, list(stripped), n=3, cutoff=0.6)]
    prefix = ".".join(map(str, key_path[:-1]))
    return f"did you mean {' or '.join(f'{prefix}.{c}' if prefix else c for c in close)}?" if close else ""


def _field_section(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The section class of a known field (optional sections unwrapped); None for values and dict-valued fields."""
    annotation = model.model_fields[name].annotation
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _section_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The section class at a key path, by walking the schema; None where the path is not a section."""
    model: type[BaseModel] | None = Config
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _field_section(model, part)
    return model


def _section_keys(path: tuple[str | int, ...]) -> list[str] | None:
    """The keys allowed at a location; None where it is not a section."""
    model = _section_at(path)
    return sorted(model.model_fields) if model is not None else None


def _merge(base: Any, update: Any, section: type[BaseModel] | None) -> Any:
    """`update` laid over `base`: a section merges key by key, anything else is replaced whole.

    Dict-valued fields (grpo.reward_function, engine.limit_mm_per_prompt) are values, so a table
    written for one replaces its default: a recipe can drop a reward. Sections keep every key the
    update does not name, with the value it had (their defaults may differ from the section class's
    own, e.g. rollout.sampling_config's temperature of 1.0).
    """
    if section is None or not isinstance(base, dict) or not isinstance(update, dict):
        return update
    merged = dict(base)
    for key, value in update.items():
        child = _field_section(section, key) if key in section.model_fields else None
        merged[key] = _merge(merged[key], value, child) if key in merged else value
    return merged


def _leaf_keys(prefix: str, value: Any) -> list[str]:
    """Full dotted keys under an unknown table, so moved cosmos-rl keys inside it are recognised."""
    if not isinstance(value, dict):
        return [prefix]
    return [key for name, child in value.items() for key in _leaf_keys(f"{prefix}.{name}", child)]


def _leaf_keys_of(tree: Mapping[str, Any]) -> list[str]:
    """Every dotted key a (possibly nested) recipe table names, down to its plain values."""
    return [key for name, value in tree.items() for key in _leaf_keys(name, value)]


def _moved_hints(key: str, value: Any) -> list[str]:
    hints = []
    for leaf in _leaf_keys(key, value):
        # The most specific entry wins: a whole moved table is named only when no key inside it is known.
        match = max((k for k in MOVED_KEYS if leaf == k or leaf.startswith(k + ".")), key=len, default=None)
        if match is not None:
            hint = f"{match} is called {MOVED_KEYS[match]} here"
            if hint not in hints:
                hints.append(hint)
    return hints


def _explain(error: ValidationError, source: str) -> ConfigError:
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"])
        key = ".".join(str(p) for p in loc) or "<top level>"
        if item["type"] == "extra_forbidden":
            hints = _moved_hints(key, item.get("input"))
            allowed = _section_keys(loc[:-1])
            if not hints and (suggestion := _suggestion(loc, allowed)):
                hints.append(suggestion)
            hint = f" ({'; '.join(hints)})" if hints else ""
            allowed_text = (
                f" Allowed keys in [{'.'.join(map(str, loc[:-1])) or 'top level'}]: {', '.join(allowed)}."
                if allowed
                else ""
            )
            lines.append(f"{key}: unknown key{hint}.{allowed_text}")
        else:
            got = item.get("input")
            got_text = ""
            if got is not None and not isinstance(got, dict):
                got_text = f" (got {_shown(repr(got)) if _nesting(got) <= MAX_NESTING else 'a value nested too deep'})"
            lines.append(f"{key}: {item['msg'].removeprefix('Value error, ')}{got_text}")
    # One line: a log or a terminal shows the whole error, each problem naming its key.
    return ConfigError(f"invalid configuration in {source}: " + "; ".join(lines))


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b=value` into a key path and a TOML-typed value (else JSON; bare words stay strings)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no '=': write --set section.key=value, e.g. --set train.optm_lr=2e-6")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise ConfigError(f"override {text!r} has an empty key: write --set section.key=value")
    raw = raw.strip()
    shown = f"override {_shown(text)!r}"
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
        # a table or list typed as JSON ({"accuracy": 1.0}) is what shells and other tools' docs hand users; only
        # those, so bare words that JSON also reads (null, NaN, Infinity) stay strings
        if raw.strip().startswith(("{", "[")):
            try:
                value = json.loads(raw)
            except RecursionError as exc:
                raise ConfigError(f"{shown}: {key.strip()} holds {_parse_problem(exc)}") from None
            except ValueError as exc:
                if "digits" in str(exc):  # a JSON table holding a 5,000-digit integer
                    raise ConfigError(f"{shown}: {key.strip()} holds {_parse_problem(exc)}") from None
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError, caught above
        raise ConfigError(f"{shown}: {key.strip()} holds {_parse_problem(exc)}") from None
    if _nesting(value) > MAX_NESTING:
        raise ConfigError(f"{shown}: {key.strip()} holds {_parse_problem(RecursionError())}")
    return [p.strip() for p in parts], value


def _not_a_section(text: str, parts: list[str], index: int) -> ConfigError:
    """The error for an override whose key path goes below the plain value at parts[index]."""
    value_key = ".".join(parts[: index + 1])
    return ConfigError(
        f"override {text!r}: {value_key} is a value, not a section, so it has no key {parts[index + 1]!r}"
    )


def _check_override_path(parts: list[str], text: str) -> None:
    """Refuse a key path that goes below a plain value (e.g. train.epoch.x), before anything is applied."""
    model: type[BaseModel] | None = Config
    for i, part in enumerate(parts[:-1]):
        if model is None or part not in model.model_fields:
            return  # unknown keys are reported by validation, with the allowed keys
        annotation = model.model_fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = _field_section(model, part)
        is_table = model is not None or any(getattr(c, "__origin__", None) is dict or c is dict for c in candidates)
        if not is_table:
            raise _not_a_section(text, parts, i)


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    """Set one key path in the recipe tree: a dotted key changes one entry, the rest keep their values.

    A table value (`--set 'grpo.reward_function={accuracy=1}'`) replaces a dict-valued field whole
    and merges into a section, as a table in the file does.
    """
    _check_override_path(parts, text)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:  # absent, or an optional section left at None (plain values were refused above)
            child = node[part] = {}
        if not isinstance(child, dict):
            raise _not_a_section(text, parts, i)
        node = child
    node[parts[-1]] = _merge(node.get(parts[-1]), value, _section_at(parts))


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    values: Mapping[str, Any] | None = None,
) -> Config:
    """Load a TOML recipe (or the defaults when path is None), apply overrides, then typed values, validate.

    The file is laid over the defaults and each override over the result, so a key keeps its
    default (or the file's value) unless something names it; tables written for dict-valued
    fields replace them whole. `values` maps dotted keys to Python values (command-line options,
    the demo), applied last without a round trip through text. Raises ConfigError naming the file,
    the key path and what is allowed.
    """
    data: dict[str, Any] = {}
    source = "the default configuration"
    if path is not None:
        file = Path(path)
        source = str(file)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist: pass the path of a TOML recipe (see configs/)")
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8-sig"))  # -sig: a leading byte order mark is no key
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file} is not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{file} is not UTF-8 text: {exc}") from exc
        except (ValueError, RecursionError) as exc:  # a 5,000-digit integer; arrays nested a thousand deep
            text = file.read_text(encoding="utf-8")
            where = _deep_line(text) if isinstance(exc, RecursionError) else _long_number_line(text)
            raise ConfigError(f"{file}{where} holds {_parse_problem(exc)}") from None
        if (deep := _too_deep_key(data)) is not None:
            raise ConfigError(f"{file}: {deep} holds {_parse_problem(RecursionError())}")
    explicit = set(_leaf_keys_of(data))
    data = _merge(Config().model_dump(), data, Config)
    if overrides:
        source += " with overrides " + " ".join(_shown(text) for text in overrides)
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(data, parts, value, text)
        explicit.update(_leaf_keys_of({".".join(parts): value}))
    if values:
        source += " with options " + ", ".join(_shown(f"{key}={value!r}") for key, value in values.items())
    for key, value in (values or {}).items():
        _apply_override(data, key.split("."), value, f"{key}={value!r}")
        explicit.update(_leaf_keys_of({key: value}))
    try:
        return Config.model_validate(data).with_explicit_keys(frozenset(explicit))
    except ValidationError as exc:
        raise _explain(exc, source) from None


def dump_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as TOML (runs store it beside their outputs).

    Written beside and renamed over `path`: a resume compares its settings with the stored ones, and a kill
    mid-write must leave the old file or the new, never a cut-short one.
    """
    write_atomic(Path(path), tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))


def with_model(config: Config, model_dir: str | Path) -> Config:
    """The same recipe pointed at another model folder (e.g. a training stage's export)."""
    return config.model_copy(update={"model": config.model.model_copy(update={"model_name_or_path": str(model_dir)})})
