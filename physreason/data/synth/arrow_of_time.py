"""Arrow of time: is the clip playing forward or reversed? Only scenes whose energy visibly drains away qualify.

Both answers show the very same frames, only in opposite orders, so no single frame gives the answer
away: the model has to see that bounces shrink, friction stops things and swings die down.
"""

from __future__ import annotations

import numpy as np

from physreason.data.synth import narrate
from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import Sample, fixed_options, options_with_answer
from physreason.data.synth.scenarios import FPS, IRREVERSIBLE_BUILDERS, N_FRAMES
from physreason.data.synth.simulate import Trajectory, simulate

TASK = "arrow_of_time"
LABELS = ("forward", "reversed")
N_SLOTS = 4  # (forward, reversed) x (letter A, letter B)
MAX_ATTEMPTS = 50
MIN_MOVING_FRAMES = 10  # frames (of 24) with at least 2% of the starting energy

QUESTIONS = (
    "Is this video playing forward in time or in reverse?",
    "Watch how the objects move. Is the video being played forwards or backwards?",
    "Does this clip run in the normal direction of time, or has it been reversed?",
)
OPTION_TEXTS = {
    "forward": "It plays forward, in the order the events really happened.",
    "reversed": "It plays in reverse: the events are shown backwards in time.",
}


def has_arrow_cue(trajectory: Trajectory) -> bool:
    """True when energy falls to at most half, never rises noticeably, and motion fills a good part of the clip.

    Such a clip played backwards shows energy appearing from nowhere, which is what makes its
    direction answerable; `MIN_MOVING_FRAMES` keeps several frames of motion at 4 fps sampling.
    """
    energy = trajectory.energy
    if energy[0] <= 1e-6 or np.any(energy[:MIN_MOVING_FRAMES] < 0.02 * energy[0]):
        return False
    steady = bool(np.all(np.diff(energy) <= 0.02 * energy[0]))
    displacement = np.abs(trajectory.positions - trajectory.positions[:1]).max() if trajectory.positions.size else 0.0
    swing = np.abs(np.diff(trajectory.thetas, axis=0)).sum(axis=0).max() if trajectory.thetas.size else 0.0
    moves = displacement > 0.3 or swing > 0.5
    return steady and moves and energy[-1] <= 0.5 * energy[0]


def _reasoning(scene, trajectory: Trajectory, reversed_clip: bool, letter: str) -> str:
    forward = [narrate.forward_story(scene, trajectory, i) for i in range(len(scene.bodies))]
    backward = [narrate.reversed_story(scene, trajectory, i) for i in range(len(scene.bodies))]
    for k, p in enumerate(scene.pendulums):
        first, last = narrate.pendulum_amplitudes(scene, trajectory, k)
        forward.append(
            f"{p.noun} swings out to about {first:.0f} degrees and each swing is smaller, down to about {last:.0f} degrees."
        )
        backward.append(
            f"{p.noun}'s swings grow from about {last:.0f} to about {first:.0f} degrees, though nothing pushes it."
        )
    story_fwd, story_back = (
        " ".join(s[0].upper() + s[1:] for s in forward),
        " ".join(s[0].upper() + s[1:] for s in backward),
    )
    lines = ["I need to decide which way time runs in this clip, using what energy does."]
    if reversed_clip:
        lines += [
            f"In the clip: {story_back}",
            (
                "That cannot happen on its own: gaining speed or height needs energy from somewhere, and nothing "
                "in the scene supplies it. Bounces, friction and air drag only ever take energy away."
            ),
            f"Read backwards the clip makes physical sense: {story_fwd} So the real events run the other way.",
            f"The video is playing in reverse, which is option {letter}.",
        ]
    else:
        lines += [
            f"In the clip: {story_fwd}",
            (
                "This is what physics predicts: each bounce and every bit of friction or drag takes energy away, "
                "so motion dies down and nothing speeds up by itself."
            ),
            f"Played backwards the same events would show the impossible: {story_back}",
            f"The video is playing forward, which is option {letter}.",
        ]
    return "\n".join(lines)


def make_sample(seed: int, slot: int, option_order: str = "shuffled") -> Sample:
    """Build the sample for scene `seed`; `slot` in [0, 4) fixes the class (forward/reversed) and the answer letter.

    With option_order "fixed" the options are always (A) forward, (B) reversed and the slot fixes only the class.
    """
    label, letter_index = LABELS[slot // 2], slot % 2
    rng = np.random.default_rng(seed)
    kind = list(IRREVERSIBLE_BUILDERS)[rng.integers(len(IRREVERSIBLE_BUILDERS))]
    for _ in range(MAX_ATTEMPTS):  # retry within the kind, so kinds stay equally common
        scene = IRREVERSIBLE_BUILDERS[kind](rng)
        trajectory = simulate(scene, N_FRAMES, FPS)
        if has_arrow_cue(trajectory):
            break
    else:
        raise RuntimeError(
            f"arrow_of_time: no scene with a clear arrow of time in {MAX_ATTEMPTS} tries for seed {seed}"
        )
    frames = render_frames(scene, trajectory)
    reversed_clip = label == "reversed"
    clip = frames[::-1].copy() if reversed_clip else frames
    question = QUESTIONS[rng.integers(len(QUESTIONS))]
    texts = [OPTION_TEXTS["forward"], OPTION_TEXTS["reversed"]]
    if option_order == "fixed":
        options, answer = fixed_options(texts, LABELS.index(label))
    else:
        options, answer = options_with_answer(texts, LABELS.index(label), letter_index, rng)
    energy_in_clip = trajectory.energy[::-1] if reversed_clip else trajectory.energy
    return Sample(
        task=TASK,
        frames=clip,
        fps=FPS,
        question=question,
        options=options,
        answer=answer,
        label=label,
        reasoning=_reasoning(scene, trajectory, reversed_clip, answer),
        facts={
            "scene": kind,
            "reversed": reversed_clip,
            "energy_in_clip_order": [round(float(e), 4) for e in energy_in_clip],
        },
    )
