"""Temporal localization: when does a named event start and end? Answered as Cosmos-Reason2 does, in `mm:ss.ff`.

Four kinds of event, one per slot so they are balanced, each timed by the simulation itself:
- fall: a body released in mid-air falls until its first impact on the floor (contact time to 1/240 s);
- settle: from that first impact, bouncing and sliding, until it comes to rest (the first frame from which it
  stays below 0.05 m/s);
- struck: a body resting in a group is hit and moves until it comes to rest;
- hidden: a body sliding or rolling behind a screen is fully hidden from the first to the last frame in which the
  screen covers all of it.
Frame t shows time t / fps. Every event lasts at least 0.25 s and ends inside the clip; times are rounded
to hundredths in the answer. The question names the body by colour and shape.
"""

from __future__ import annotations

import json

import numpy as np

from physreason.chat.prompts import NAMED_EVENT_PROMPT
from physreason.chat.structured import format_time
from physreason.data.synth.object_permanence import find_occlusion
from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import LOCALIZATION_STREAM, Sample
from physreason.data.synth.scenarios import FPS, N_FRAMES, build_collide, build_drop, build_occlusion
from physreason.data.synth.scene import Scene
from physreason.data.synth.simulate import Trajectory, simulate

TASK = "temporal_localization"
EVENTS = ("fall", "settle", "struck", "hidden")
N_SLOTS = len(EVENTS)
MIN_DURATION = 0.25  # s: two frames at 8 fps, one at the 4 fps a model samples
MAX_ATTEMPTS = 80


def _first_floor_contact(trajectory: Trajectory, body: int) -> float | None:
    return next((e.time for e in trajectory.events if e.kind == "floor" and e.body == body), None)


def _first_collision(trajectory: Trajectory, body: int) -> float | None:
    return next((e.time for e in trajectory.events if e.kind == "collision" and body in (e.body, e.other)), None)


def _rest_time(trajectory: Trajectory, body: int) -> float | None:
    frame = trajectory.rest_frame(body)
    return None if frame is None or frame == 0 else frame / trajectory.fps


def find_event(event: str, scene: Scene, trajectory: Trajectory, body: int) -> tuple[float, float] | None:
    """(start, end) in seconds of `event` for `body`, when the clip shows it cleanly (see the module docstring)."""
    if event == "fall":
        contact = _first_floor_contact(trajectory, body)
        span = None if contact is None else (0.0, contact)
    elif event == "settle":
        contact, rest = _first_floor_contact(trajectory, body), _rest_time(trajectory, body)
        span = None if contact is None or rest is None else (contact, rest)
    elif event == "struck":
        hit, rest = _first_collision(trajectory, body), _rest_time(trajectory, body)
        span = None if hit is None or rest is None else (hit, rest)
    else:
        frames = find_occlusion(scene, trajectory, body)
        span = None if frames is None else (frames[0] / trajectory.fps, frames[1] / trajectory.fps)
    if span is None or span[1] - span[0] < MIN_DURATION or span[1] > (trajectory.n_frames - 1) / trajectory.fps:
        return None
    return span


_PHRASES = {
    "fall": "falls from where it starts until it first hits the floor",
    "settle": "keeps moving from its first impact on the floor until it comes to rest",
    "struck": "is struck and moves until it comes to rest",
    "hidden": "is completely hidden behind the screen",
}


def _scene_for(event: str, rng: np.random.Generator) -> tuple[Scene, list[int]]:
    """A scene that can show `event`, and the bodies it may concern."""
    if event in ("fall", "settle"):
        scene = build_drop(rng)
        return scene, list(range(len(scene.bodies)))
    if event == "struck":
        scene = build_collide(rng)
        return scene, list(range(1, len(scene.bodies)))  # body 0 is the striker
    scene, target = build_occlusion(rng)
    return scene, [target]


def make_sample(seed: int, slot: int, option_order: str = "shuffled") -> Sample:
    """Build the sample for scene `seed`; `slot` in [0, 4) picks the kind of event.

    `option_order` is accepted for the registry's signature; a JSON answer has no options to order.
    """
    event = EVENTS[slot]
    rng = np.random.default_rng([seed, LOCALIZATION_STREAM])
    for _ in range(MAX_ATTEMPTS):
        scene, candidates = _scene_for(event, rng)
        trajectory = simulate(scene, N_FRAMES, FPS)
        body = int(candidates[rng.integers(len(candidates))])
        span = find_event(event, scene, trajectory, body)
        if span is not None:
            break
    else:
        raise RuntimeError(f"temporal_localization: no clean {event!r} event in {MAX_ATTEMPTS} tries for seed {seed}")
    noun = scene.bodies[body].noun
    caption = f"{noun} {_PHRASES[event]}"
    start, end = format_time(span[0]), format_time(span[1])
    reasoning = (
        f"I follow {noun} through the clip. It {_PHRASES[event]}: this starts at about {span[0]:.2f} s and ends at "
        f"about {span[1]:.2f} s, so the event runs from {start} to {end}."
    )
    return Sample(
        task=TASK,
        frames=render_frames(scene, trajectory),
        fps=FPS,
        question=NAMED_EVENT_PROMPT.format(event=caption),
        options={},
        answer=json.dumps([{"start": start, "end": end, "caption": caption}]),
        label=event,
        reasoning=reasoning,
        facts={
            "body": body,
            "colour": list(scene.bodies[body].colour),
            "event": event,
            "start_s": span[0],
            "end_s": span[1],
        },
    )
