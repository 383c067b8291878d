"""Video and image input for Qwen-VL models (Qwen2.5-VL, Qwen3-VL): decode, fps sampling, pixel budgets, patches.

Returns uint8 frames plus metadata; knows nothing of models or tokens beyond the patch layout (callers pass
the model's patch factor and normalisation).
"""

from physreason.vision.image import load_image
from physreason.vision.overlay import overlay_timestamps
from physreason.vision.patches import CLIP_MEAN, CLIP_STD, num_visual_tokens, patchify
from physreason.vision.resize import PixelBudgets, pixel_budgets, smart_resize, video_frame_max_pixels
from physreason.vision.sampling import num_sampled_frames, sample_indices
from physreason.vision.video import VideoFrames, load_video

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "PixelBudgets",
    "VideoFrames",
    "load_image",
    "load_video",
    "num_sampled_frames",
    "num_visual_tokens",
    "overlay_timestamps",
    "patchify",
    "pixel_budgets",
    "sample_indices",
    "smart_resize",
    "video_frame_max_pixels",
]
