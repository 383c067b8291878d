"""Spatial puzzle: every frame is cut into a 2x2 grid and the four patches are shuffled; which arrangement is right?

The same shuffle applies to every frame, so besides static cues (the floor belongs in the bottom row,
the walls at the outer edges, the backdrop's light falls off smoothly) motion helps: a body that leaves
one patch enters its true neighbour, and falling bodies move toward the floor. Every scene has a body
lying across the middle in some frame, so the two halves can never be told apart by symmetry alone. The options name, for each true position, the shown patch that
belongs there; exactly one restores the original frames.
"""

from __future__ import annotations

import itertools

import numpy as np

from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import Sample, fixed_options, options_with_answer
from physreason.data.synth.scenarios import FPS, IRREVERSIBLE_BUILDERS, N_FRAMES
from physreason.data.synth.scene import Scene
from physreason.data.synth.simulate import Trajectory, simulate

TASK = "spatial_puzzle"
POSITIONS = ("top-left", "top-right", "bottom-left", "bottom-right")  # reading order; index = 2 * row + column
N_OPTIONS = 4
N_SLOTS = N_OPTIONS  # the slot is the correct letter
MAX_ATTEMPTS = 20
# option_order "fixed": the four shuffles a clip may get, listed as options in this order. Each puts the
# floor or the walls somewhere else (rows swapped; columns swapped; both; top-right and bottom-left
# swapped), so static cues alone tell them apart. All are their own inverse: the arrangement is the shuffle.
FIXED_SHUFFLES = ((2, 3, 0, 1), (1, 0, 3, 2), (3, 2, 1, 0), (0, 2, 1, 3))

QUESTION = (
    "Each frame of this video was cut into a 2x2 grid of patches (top-left, top-right, bottom-left, bottom-right) "
    "and the four patches were shuffled; the same shuffle was applied to every frame. Which arrangement restores "
    "the original scene? Each option says, for every position of the original frame, which shown patch belongs there."
)


def shuffle_patches(frames: np.ndarray, shown_from: tuple[int, ...]) -> np.ndarray:
    """Patch `shown_from[p]` of the original goes to position p; frames [T, H, W, 3] with H and W even."""
    t, h, w, c = frames.shape
    tiles = frames.reshape(t, 2, h // 2, 2, w // 2, c).transpose(1, 3, 0, 2, 4, 5).reshape(4, t, h // 2, w // 2, c)
    shuffled = tiles[list(shown_from)]  # [4, T, h/2, w/2, 3]
    return shuffled.reshape(2, 2, t, h // 2, w // 2, c).transpose(2, 0, 3, 1, 4, 5).reshape(t, h, w, c)


def restore_patches(frames: np.ndarray, arrangement: tuple[int, ...]) -> np.ndarray:
    """Undo a shuffle: `arrangement[q]` is the shown position whose patch belongs at original position q."""
    return shuffle_patches(frames, arrangement)


def _describe(arrangement: tuple[int, ...]) -> str:
    return "; ".join(f"{POSITIONS[q]}: shown {POSITIONS[p]}" for q, p in enumerate(arrangement))


def _patch_of(scene: Scene, x: float, y: float) -> int:
    col, row = scene.camera.to_px(x, y)
    return 2 * int(row >= scene.camera.height_px / 2) + int(col >= scene.camera.width_px / 2)


def _straddles_middle(scene: Scene, trajectory: Trajectory) -> bool:
    """True if some body or bob lies across the vertical midline in some frame, joining the left and right halves."""
    middle = scene.camera.width_px / 2
    for t in range(trajectory.n_frames):
        for i, body in enumerate(scene.bodies):
            col = scene.camera.to_px(*trajectory.positions[t, i])[0]
            if abs(col - middle) < 0.6 * body.half_width * scene.camera.scale:
                return True
        for k, p in enumerate(scene.pendulums):
            col = scene.camera.to_px(p.pivot_x + p.length * np.sin(trajectory.thetas[t, k]), 0.0)[0]
            if abs(col - middle) < 0.6 * p.bob_radius * scene.camera.scale:
                return True
    return False


def _motion_cue(scene: Scene, trajectory: Trajectory, position_of: list[int]) -> str | None:
    """A sentence about a body crossing from one patch into its neighbour, in shown-patch terms, if any does."""
    for i, body in enumerate(scene.bodies):
        patches = [_patch_of(scene, *trajectory.positions[t, i]) for t in range(trajectory.n_frames)]
        for t in range(1, len(patches)):
            a, b = patches[t - 1], patches[t]
            if a == b or a + b == 3:  # same patch, or a diagonal jump that says little
                continue
            relation = {1: "to the right of", -1: "to the left of", 2: "below", -2: "above"}[b - a]
            return (
                f"At about {t / trajectory.fps:.1f} s {body.noun} leaves shown {POSITIONS[position_of[a]]} and enters "
                f"shown {POSITIONS[position_of[b]]}, so that patch lies directly {relation} it in the original."
            )
    return None


def _reasoning(
    scene: Scene, trajectory: Trajectory, shown_from: tuple[int, ...], arrangement: tuple[int, ...], letter: str
) -> str:
    position_of = list(arrangement)  # original position -> shown position
    opening = (
        "I need to work out where each shown patch came from. The floor belongs in the bottom row, the arena's walls "
        "at the outer left and right edges, and moving objects must pass smoothly from a patch into its true neighbour."
    )
    lines = [opening]
    for p, q in enumerate(shown_from):
        row = "the floor along its bottom" if q >= 2 else "no floor, only open space"
        column = "a wall near its left edge" if q % 2 == 0 else "a wall near its right edge"
        lines.append(f"Shown {POSITIONS[p]} has {row} and {column}, so it belongs at the {POSITIONS[q]}.")
    cue = _motion_cue(scene, trajectory, position_of)
    if cue:
        lines.append(cue)
    lines.append(f"So the original frame is: {_describe(arrangement)}. That matches option {letter}.")
    return "\n".join(lines)


def choose_scene(rng: np.random.Generator) -> tuple[str, Scene, Trajectory]:
    """Draw a scene kind and a simulated scene of it in which some body lies across the middle."""
    kind = list(IRREVERSIBLE_BUILDERS)[rng.integers(len(IRREVERSIBLE_BUILDERS))]
    for _ in range(MAX_ATTEMPTS):
        scene = IRREVERSIBLE_BUILDERS[kind](rng)
        trajectory = simulate(scene, N_FRAMES, FPS)
        if _straddles_middle(scene, trajectory):
            return kind, scene, trajectory
    raise RuntimeError(f"spatial_puzzle: no {kind} scene joining the two halves in {MAX_ATTEMPTS} tries")


def make_sample(seed: int, slot: int, option_order: str = "shuffled") -> Sample:
    """Build the sample for scene `seed`; `slot` in [0, 4) is the correct option's letter.

    option_order "shuffled": any of the 23 shuffles, three random wrong arrangements as distractors.
    "fixed": the shuffle is FIXED_SHUFFLES[slot] and the options are always those four, in that order.
    """
    rng = np.random.default_rng(seed)
    kind, scene, trajectory = choose_scene(rng)
    frames = render_frames(scene, trajectory)
    if option_order == "fixed":
        shown_from = FIXED_SHUFFLES[slot]
    else:
        permutations = [p for p in itertools.permutations(range(4)) if p != (0, 1, 2, 3)]
        shown_from = permutations[rng.integers(len(permutations))]
    clip = shuffle_patches(frames, shown_from)
    arrangement = tuple(int(np.argsort(shown_from)[q]) for q in range(4))  # original position -> shown position
    if option_order == "fixed":
        options, answer = fixed_options([_describe(a) for a in FIXED_SHUFFLES], slot)
    else:
        wrong = [p for p in itertools.permutations(range(4)) if p != arrangement]
        distractors = [wrong[i] for i in rng.choice(len(wrong), size=N_OPTIONS - 1, replace=False)]
        texts = [_describe(arrangement)] + [_describe(d) for d in distractors]
        options, answer = options_with_answer(texts, 0, slot, rng)
    return Sample(
        task=TASK,
        frames=clip,
        fps=FPS,
        question=QUESTION,
        options=options,
        answer=answer,
        label=answer,
        reasoning=_reasoning(scene, trajectory, shown_from, arrangement, answer),
        facts={"scene": kind, "shown_from": list(shown_from), "arrangement": list(arrangement)},
    )
