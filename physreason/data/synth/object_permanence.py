"""Object permanence: a body slides or rolls behind a screen; does anything vanish in a way physics forbids?

Half the samples are physical (the body comes out on the far side). In the other half the body is
removed from the clip: either while fully hidden behind the screen (it never comes out, though its
speed says it must) or in plain view (it blinks out of existence). Removal only hides the body from
the render; scenes are chosen so that it never touches another body, so everything else is unchanged.
"""

from __future__ import annotations

import numpy as np

from physreason.data.synth import narrate
from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import Sample, fixed_options, options_with_answer
from physreason.data.synth.scenarios import FPS, N_FRAMES, build_occlusion
from physreason.data.synth.scene import Scene
from physreason.data.synth.simulate import Trajectory, simulate

TASK = "object_permanence"
LABELS = ("persists", "vanishes_behind", "vanishes_in_open")
# Half the slots are physical, so "yes" and "no" are balanced; each slot also fixes the letter.
SLOT_LABELS = ("persists", "persists", "vanishes_behind", "vanishes_in_open")
N_SLOTS = 2 * len(SLOT_LABELS)
MAX_ATTEMPTS = 60
VISIBLE, HIDDEN = 0.01, 0.99  # covered fractions

QUESTION = "Does any object in this video disappear in a way that physics does not allow?"
OPTION_TEXTS = {
    "violation": "Yes: an object vanishes instead of staying in the scene.",
    "physical": "No: every object stays in the scene, even if it is hidden for a while.",
}


def find_occlusion(scene: Scene, trajectory: Trajectory, target: int) -> tuple[int, int] | None:
    """(first, last) frame of the target's first full occlusion, if the clip shows a clean pass behind the screen.

    Clean means: fully visible in the first three frames, fully hidden for at least two frames (so a
    model sampling at half the frame rate still sees it hidden), fully visible again in the last three
    frames, barely slowed when it goes behind, and never touching another body.
    """
    covered = narrate.occlusion_series(scene, trajectory, target)
    if np.any(covered[:3] > VISIBLE) or np.any(covered[-3:] > VISIBLE):
        return None
    if any(e.kind == "collision" and target in (e.body, e.other) for e in trajectory.events):
        return None
    hidden = np.nonzero(covered >= HIDDEN)[0]
    if hidden.size < 2:
        return None
    first = int(hidden[0])
    last = first
    while last + 1 < len(covered) and covered[last + 1] >= HIDDEN:
        last += 1
    if last - first + 1 < 2:
        return None
    speeds = trajectory.speeds()[:, target]
    if speeds[first] < 0.8 * speeds[0]:
        return None
    return first, last


def _open_frames(scene: Scene, trajectory: Trajectory, target: int) -> list[int]:
    """Frames at which the target could vanish in plain view: fully visible, clear of the screen, and moving."""
    body, screen = scene.bodies[target], scene.occluders[0]
    covered = narrate.occlusion_series(scene, trajectory, target)
    frames = []
    for t in range(3, trajectory.n_frames - 4):
        x = trajectory.positions[t - 1 : t + 1, target, 0]  # [2]: the last frame it is seen and the first it is not
        clear = np.all((x + 2 * body.half_width < screen.x0) | (x - 2 * body.half_width > screen.x1))
        if clear and covered[t - 1] < VISIBLE and covered[t] < VISIBLE and trajectory.speeds()[t, target] > 0.3:
            frames.append(t)
    return frames


def _reasoning(
    scene: Scene,
    trajectory: Trajectory,
    target: int,
    label: str,
    occlusion: tuple[int, int],
    vanish: int | None,
    letter: str,
) -> str:
    body, screen, fps = scene.bodies[target], scene.occluders[0], trajectory.fps
    first, last = occlusion
    vx = trajectory.velocities[0, target, 0]
    verb = "rolls" if body.kind == "ball" else "slides"
    others = [n for i, n in enumerate(narrate.visible_objects(scene)) if i != target]
    scene_line = (
        f"The scene shows {narrate.join(narrate.visible_objects(scene) + ['a striped screen standing on the floor'])}."
    )
    lines = ["I should follow every object and check that none stops existing.", scene_line]
    came_out = (last + 1) / fps
    if label == "persists":
        lines.append(
            f"{body.noun.capitalize()} {verb} {narrate.direction(vx)} toward the screen, goes fully behind it at about "
            f"{first / fps:.1f} s, stays hidden until about {came_out:.1f} s, then comes out on the "
            f"{narrate.direction(vx)} side and is still in view at the end."
        )
    elif label == "vanishes_behind":
        speed = trajectory.speeds()[first, target]
        lines.append(
            f"{body.noun.capitalize()} {verb} {narrate.direction(vx)} toward the screen and goes fully behind it at about "
            f"{first / fps:.1f} s. It is moving at about {speed:.1f} m/s and barely slowing down, and the screen is only "
            f"about {screen.x1 - screen.x0:.1f} m wide, so it should come out on the {narrate.direction(vx)} side by about "
            f"{came_out:.1f} s. It never comes out, and it is not seen again for the rest of the clip."
        )
    else:
        assert vanish is not None
        x = trajectory.positions[vanish - 1, target, 0]
        where = (
            "before it reaches the screen"
            if (x < screen.x0) == (vx > 0)
            else "after it has come out from behind the screen"
        )
        lines.append(
            f"{body.noun.capitalize()} {verb} {narrate.direction(vx)}. At about {vanish / fps:.1f} s, out in the open "
            f"{where}, it disappears from one frame to the next, with nothing in front of it."
        )
    if others:
        lines.append(
            f"{narrate.join(others).capitalize()} {'remains' if len(others) == 1 else 'remain'} in the scene throughout."
        )
    if label == "persists":
        lines.append(
            f"Every object present at the start is still there at the end; {body.noun} was only hidden by the screen "
            f"for a while. Nothing disappears in a way physics forbids, so the answer is option {letter}."
        )
    else:
        lines.append(
            "Objects do not stop existing: a hidden object is still there and must come out again, and an object in plain "
            f"view cannot blink out. {body.noun.capitalize()} vanishes, which physics does not allow, so the answer is option {letter}."
        )
    return "\n".join(lines)


def make_sample(seed: int, slot: int, option_order: str = "shuffled") -> Sample:
    """Build the sample for scene `seed`; `slot` in [0, 8) fixes the class and the answer letter.

    With option_order "fixed" the options are always (A) violation, (B) physical and the slot fixes only the class.
    """
    label, letter_index = SLOT_LABELS[slot // 2], slot % 2
    rng = np.random.default_rng(seed)
    for _ in range(MAX_ATTEMPTS):
        scene, target = build_occlusion(rng)
        trajectory = simulate(scene, N_FRAMES, FPS)
        occlusion = find_occlusion(scene, trajectory, target)
        open_frames = _open_frames(scene, trajectory, target) if occlusion else []
        if occlusion and (label != "vanishes_in_open" or open_frames):
            break
    else:
        raise RuntimeError(f"object_permanence: no clean occlusion scene in {MAX_ATTEMPTS} tries for seed {seed}")
    vanish: int | None = None
    if label == "vanishes_behind":
        vanish = occlusion[0] + 1
    elif label == "vanishes_in_open":
        vanish = open_frames[rng.integers(len(open_frames))]
    hidden = np.zeros((trajectory.n_frames, len(scene.bodies)), dtype=bool)  # [frames, bodies]
    if vanish is not None:
        hidden[vanish:, target] = True
    frames = render_frames(scene, trajectory, hidden)
    violation = label != "persists"
    texts = [OPTION_TEXTS["violation"], OPTION_TEXTS["physical"]]
    if option_order == "fixed":
        options, answer = fixed_options(texts, 0 if violation else 1)
    else:
        options, answer = options_with_answer(texts, 0 if violation else 1, letter_index, rng)
    return Sample(
        task=TASK,
        frames=frames,
        fps=FPS,
        question=QUESTION,
        options=options,
        answer=answer,
        label=label,
        reasoning=_reasoning(scene, trajectory, target, label, occlusion, vanish, answer),
        facts={
            "target": target,
            "target_colour": list(scene.bodies[target].colour),
            "occluded_frames": [occlusion[0], occlusion[1]],
            "vanish_frame": vanish,
            "violation": violation,
        },
    )
