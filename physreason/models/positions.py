"""Qwen2.5-VL 3D rotary (M-RoPE) position ids of one sample, computed from its token ids and visual grids.

Computed in the data pipeline, per sample, so that packed sequences restart positions at each sample
and the trainer never depends on a transformers-version-specific `get_rope_index` signature.
"""

from __future__ import annotations

import torch


def mrope_position_ids(
    input_ids: torch.Tensor,  # [L]
    image_token_id: int,
    video_token_id: int,
    image_grid_thw: torch.Tensor | None,  # [n_images, 3]
    video_grid_thw: torch.Tensor | None,  # [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None,  # [n_videos]
    spatial_merge_size: int = 2,
    tokens_per_second: float = 2.0,
) -> torch.Tensor:
    """Return [3, L] (temporal, height, width) positions: text advances by 1, vision spans by their grid.

    Each run of image/video pad tokens is one visual input, consumed in order from its grid list.
    """
    ids = input_ids.tolist()
    images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    videos = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    seconds = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else [])
    pieces: list[torch.Tensor] = []
    current = 0
    i = 0
    while i < len(ids):
        token = ids[i]
        if token not in (image_token_id, video_token_id):
            j = i
            while j < len(ids) and ids[j] not in (image_token_id, video_token_id):
                j += 1
            pieces.append(torch.arange(current, current + j - i).expand(3, -1))
            current += j - i
            i = j
            continue
        t, h, w = next(images) if token == image_token_id else next(videos)
        # transformers takes 1 second per temporal patch when a video comes without second_per_grid_ts
        if token == video_token_id:
            interval = tokens_per_second * (next(seconds) if second_per_grid_ts is not None else 1.0)
        else:
            interval = 1.0
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        temporal = (torch.arange(t) * interval).long()  # [t]
        grid = torch.stack(
            torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
        ).reshape(3, -1)  # [3, t*gh*gw]
        pieces.append(grid + current)
        current += max(gh, gw)
        i += grid.shape[1]
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1).long()
