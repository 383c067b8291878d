"""Frame-count, index and pixel-budget rules (pure functions), pinned on hand-checked values."""

from __future__ import annotations

import itertools

import pytest

from physreason.vision import num_sampled_frames, sample_indices, smart_resize, video_frame_max_pixels


def test_thirty_second_clip_at_4_fps_samples_120_evenly_spaced_frames():
    count = num_sampled_frames(900, 30.0, 4.0, min_frames=4, max_frames=768)
    indices = sample_indices(900, count)
    assert count == 120
    assert indices[0] == 0 and indices[-1] == 899
    assert all(7 <= b - a <= 8 for a, b in itertools.pairwise(indices))


def test_frame_count_is_even_and_respects_min_and_max_frames():
    assert num_sampled_frames(90, 30.0, 4.0, min_frames=4, max_frames=768) == 12
    assert num_sampled_frames(10, 30.0, 4.0, min_frames=4, max_frames=768) == 4  # raised to min_frames
    assert num_sampled_frames(10, 30.0, 4.0, min_frames=5, max_frames=768) == 6  # min_frames rounds up to even
    assert num_sampled_frames(900, 30.0, 30.0, min_frames=4, max_frames=17) == 16  # max_frames rounds down
    assert num_sampled_frames(77, 25.0, 2.0, min_frames=4, max_frames=768) == 6  # 6.16 rounds down to even


def test_frame_count_never_exceeds_the_source_frames():
    assert num_sampled_frames(3, 30.0, 4.0, min_frames=4, max_frames=768) == 2
    assert num_sampled_frames(7, 1.0, 4.0, min_frames=4, max_frames=768) == 6


def test_one_frame_video_is_repeated_to_one_temporal_patch():
    count = num_sampled_frames(1, 30.0, 4.0, min_frames=4, max_frames=768)
    assert count == 2
    assert sample_indices(1, count) == [0, 0]


def test_sample_indices_round_half_to_even_like_the_reference():
    # linspace(0, 5, 3) = [0, 2.5, 5]; 2.5 rounds to 2 (numpy and torch round half to even).
    assert sample_indices(6, 3) == [0, 2, 5]


def test_smart_resize_keeps_sides_multiple_of_28_within_budget():
    assert smart_resize(720, 1280, min_pixels=100352, max_pixels=602112) == (560, 1008)
    assert smart_resize(64, 96, min_pixels=100352, max_pixels=602112) == (280, 392)  # scaled up to min_pixels
    assert smart_resize(224, 448) == (224, 448)  # already fits: unchanged
    assert smart_resize(10, 10) == (56, 56)  # image default min_pixels 4 * 28 * 28


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)


def test_total_budget_counts_a_pair_of_frames():
    # 6,422,528 = 8192 * 28**2 shared by 120 frames: each frame gets 2 / 120 of it.
    share = video_frame_max_pixels(120, min_pixels=100352, max_pixels=602112, total_pixels=6422528)
    assert share == pytest.approx(6422528 / 120 * 2)
    assert smart_resize(720, 1280, min_pixels=100352, max_pixels=share) == (224, 420)


def test_frame_share_is_floored_at_105_percent_of_min_pixels_and_capped_at_max_pixels():
    assert video_frame_max_pixels(1000, min_pixels=100352, max_pixels=602112, total_pixels=6422528) == int(
        100352 * 1.05
    )
    assert video_frame_max_pixels(4, min_pixels=100352, max_pixels=602112, total_pixels=6422528) == 602112
