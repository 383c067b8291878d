"""What a model is given for one request, in words: the rendered prompt, each video's frames and sizes, token counts.

`physreason infer --print-prompt` prints it without loading the model, so a user sees the system prompt, the
chat template's layout and how much of each clip was sampled before spending a GPU minute on it.
"""

from __future__ import annotations

from physreason.config import ModelConfig
from physreason.engines.base import GenerationRequest


def describe_prompt(request: GenerationRequest, model: ModelConfig) -> str:
    """The prompt text rendered by the model's chat template, then one block per video and image."""
    from physreason.models import loading
    from physreason.models.inputs import encode_visuals, load_processor_params

    tokenizer = loading.load_tokenizer(model)
    text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
    visuals = encode_visuals(
        request.images, request.videos, load_processor_params(model.model_name_or_path, model.revision)
    )
    lines = [f"prompt ({model.model_name_or_path}'s chat template; each vision placeholder stands for the tokens below):",
             text, ""]
    for video, tokens in zip(request.videos, visuals.video_token_counts, strict=True):
        count, height, width = video.frames.shape[0], video.frames.shape[1], video.frames.shape[2]
        source_h, source_w = video.source_size
        lines.append(
            f"video {video.path}: {count} frames of {width}x{height} (source {source_w}x{source_h}, "
            f"{video.source_fps:.3g} fps, {video.duration:.2f} s), sampled at {video.sample_fps:.3g} fps, "
            f"{tokens} visual tokens"
        )
        lines.append("  frame times (s): " + " ".join(f"{t:.2f}" for t in video.timestamps))
    for index, (image, tokens) in enumerate(zip(request.images, visuals.image_token_counts, strict=True), start=1):
        lines.append(f"image {index}: {image.shape[1]}x{image.shape[0]}, {tokens} visual tokens")
    return "\n".join(lines)
