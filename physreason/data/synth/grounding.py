"""2D grounding: where is a body, named by colour and shape, in the frame at a named time? Answered as Cosmos-Reason2 does.

Half the samples ask for the body's bounding box (`box_2d`), half for its centre point (`point_2d`), each
axis normalised to 0-1000 of the frame (Cosmos-Reason2's `prompts/2d_grounding.yaml`). The box is the
body's exact extent projected by the scene's camera, so it is true of the rendered pixels to within the
anti-aliased edge. Named times are multiples of 0.5 s, so any sampling of 2 fps or more shows that frame.

The 0-1000 grid is the one stored form for every family: Cosmos-Reason1 (Qwen2.5-VL) grounds in pixels of the
frame as it sees it, a size set by the run's vision settings, not known here; rewards, evaluation and SFT
(the records' `"coords": "norm1000"`) convert with that size. So the reasoning names positions as shares of the
frame, true on either grid, and leaves the numbers to the answer.
"""

from __future__ import annotations

import json

import numpy as np

from physreason.chat.prompts import GROUNDING_PROMPT, POINT_GROUNDING_PROMPT
from physreason.chat.structured import COORD_MAX, format_time
from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import LOCALIZATION_STREAM, Sample
from physreason.data.synth.scenarios import FPS, N_FRAMES, build_collide, build_drop, build_slide
from physreason.data.synth.scene import Scene
from physreason.data.synth.simulate import Trajectory, simulate

TASK = "grounding"
VARIANTS = ("box_2d", "point_2d")
N_SLOTS = len(VARIANTS)
NAMED_FRAMES = tuple(range(0, N_FRAMES, FPS // 2))  # every 0.5 s
BUILDERS = (build_drop, build_slide, build_collide)
MAX_ATTEMPTS = 50


def body_box(scene: Scene, trajectory: Trajectory, body: int, frame: int) -> tuple[float, float, float, float]:
    """The body's box [x1, y1, x2, y2] in pixels of the rendered frame (x right, y down)."""
    b, (x, y) = scene.bodies[body], trajectory.positions[frame, body]
    left, top = scene.camera.to_px(x - b.half_width, y + b.half_height)
    right, bottom = scene.camera.to_px(x + b.half_width, y - b.half_height)
    return left, top, right, bottom


def normalised_box(scene: Scene, box: tuple[float, float, float, float]) -> list[int]:
    """A pixel box as integers on the 0-1000 grid of each axis."""
    w, h = scene.camera.width_px, scene.camera.height_px
    x1, y1, x2, y2 = box
    return [round(COORD_MAX * x1 / w), round(COORD_MAX * y1 / h), round(COORD_MAX * x2 / w), round(COORD_MAX * y2 / h)]


def _inside(scene: Scene, box: tuple[float, float, float, float]) -> bool:
    x1, y1, x2, y2 = box
    return 0 <= x1 and x2 <= scene.camera.width_px and 0 <= y1 and y2 <= scene.camera.height_px


def _where(box: list[int]) -> str:
    centre = (box[0] + box[2]) / 2
    return "left" if centre < 333 else "right" if centre > 667 else "middle"


def _share(coordinate: int) -> str:
    """A 0-1000 coordinate as a percentage of the frame, the same on every family's grid."""
    return f"{round(coordinate / 10)}%"


def make_sample(seed: int, slot: int, option_order: str = "shuffled") -> Sample:
    """Build the sample for scene `seed`; `slot` in [0, 2) picks the box or the point question.

    `option_order` is accepted for the registry's signature; a JSON answer has no options to order.
    """
    variant = VARIANTS[slot]
    rng = np.random.default_rng([seed, LOCALIZATION_STREAM])
    for _ in range(MAX_ATTEMPTS):
        scene = BUILDERS[rng.integers(len(BUILDERS))](rng)
        trajectory = simulate(scene, N_FRAMES, FPS)
        frame = int(NAMED_FRAMES[rng.integers(len(NAMED_FRAMES))])
        body = int(rng.integers(len(scene.bodies)))
        pixels = body_box(scene, trajectory, body, frame)
        if _inside(scene, pixels):
            break
    else:
        raise RuntimeError(f"grounding: no body fully in view in {MAX_ATTEMPTS} tries for seed {seed}")
    noun = scene.bodies[body].noun
    time = format_time(frame / FPS)
    box = normalised_box(scene, pixels)
    point = [round((box[0] + box[2]) / 2), round((box[1] + box[3]) / 2)]
    object_name = f"{noun} in the frame at {time}"
    on_floor = trajectory.positions[frame, body, 1] - scene.bodies[body].half_height < 0.02
    seen = (
        f"I look at the frame at {time} for {noun}. It is {'on the floor' if on_floor else 'in mid-air'}, in the "
        f"{_where(box)} part of the frame; its edges lie at about {_share(box[0])} to {_share(box[2])} of the "
        f"frame's width from the left and {_share(box[1])} to {_share(box[3])} of its height from the top."
    )
    if variant == "box_2d":
        question = GROUNDING_PROMPT.format(object_name=object_name)
        answer = json.dumps([{"box_2d": box, "label": noun}])
        reasoning = f"{seen}\nSo I give its bounding box."
        reference = {}
    else:
        question = POINT_GROUNDING_PROMPT.format(object_name=object_name)
        answer = json.dumps([{"point_2d": point, "label": noun}])
        reasoning = f"{seen}\nSo I give its centre point, halfway between those edges."
        reference = {"box_2d": box}  # the point reward credits any point inside the body
    return Sample(
        task=TASK,
        frames=render_frames(scene, trajectory),
        fps=FPS,
        question=question,
        options={},
        answer=answer,
        label=variant,
        reasoning=reasoning,
        facts={
            "body": body,
            "colour": list(scene.bodies[body].colour),
            "frame": frame,
            "box_2d": box,
            "point_2d": point,
        },
        reference=reference,
    )
