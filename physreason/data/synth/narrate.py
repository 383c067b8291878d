"""Plain-English accounts of what happens in a simulated scene, in forward time, for reasoning traces.

Everything said here is read off the simulation (positions, velocities, events), never guessed, so a
reasoning trace built from it is true of the clip.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from physreason.data.synth.scene import GRAVITY, Body, Pendulum, Scene
from physreason.data.synth.simulate import REST_SPEED, Trajectory

ON_FLOOR = 0.02  # m: a body whose bottom is this close to the floor stands on it


def join(phrases: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    if len(phrases) <= 1:
        return "".join(phrases)
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def direction(vx: float) -> str:
    """'right' or 'left' for a horizontal velocity as seen in the image."""
    return "right" if vx > 0 else "left"


def swing_amplitude(pendulum: Pendulum, theta: float, omega: float) -> float:
    """The largest angle (degrees) the pendulum reaches with its current energy and no further losses."""
    cos_peak = math.cos(theta) - pendulum.length * omega**2 / (2 * GRAVITY)
    return math.degrees(math.acos(min(1.0, max(-1.0, cos_peak))))


@dataclass
class BodyHistory:
    """What one body does over the clip, in forward time."""

    start: str  # "air_rest", "air_moving", "floor_rest" or "floor_moving"
    height: float  # m of its bottom above the floor at the start
    speed: float  # m/s at the start
    vx: float  # m/s horizontal velocity at the start
    floor_hits: int  # impacts with the floor worth noticing
    bounces_shrink: bool  # every floor impact slower than the one before
    wall_hits: list[str]  # "left"/"right", in order
    partners: list[int]  # bodies it collided with, in order of first contact
    rest_frame: int | None  # frame from which it stays at rest; None if it moves to the end
    rests_on_floor: bool


def body_history(scene: Scene, trajectory: Trajectory, index: int) -> BodyHistory:
    """Summarise body `index`'s trajectory and events."""
    body = scene.bodies[index]
    y, (vx, vy) = trajectory.positions[0, index, 1], trajectory.velocities[0, index]
    height = float(y - body.half_height)
    speed = float(math.hypot(vx, vy))
    start = ("floor" if height < ON_FLOOR else "air") + ("_moving" if speed >= REST_SPEED else "_rest")
    partners: list[int] = []
    walls: list[str] = []
    floor_speeds: list[float] = []
    for event in trajectory.events:
        if event.kind == "floor" and event.body == index:
            floor_speeds.append(event.speed)
        elif event.kind == "wall" and event.body == index:
            frame = min(trajectory.n_frames - 1, round(event.time * trajectory.fps))
            walls.append("left" if trajectory.positions[frame, index, 0] < scene.width / 2 else "right")
        elif event.kind == "collision" and index in (event.body, event.other):
            other = event.other if event.body == index else event.body
            if other is not None and other not in partners:
                partners.append(other)
    final_bottom = trajectory.positions[-1, index, 1] - body.half_height
    return BodyHistory(
        start, height, speed, float(vx), len(floor_speeds),
        all(b < a for a, b in itertools.pairwise(floor_speeds)), walls, partners,
        trajectory.rest_frame(index), bool(final_bottom < ON_FLOOR),
    )  # fmt: skip


def _moving_verb(body: Body) -> str:
    return "rolling" if body.kind == "ball" else "sliding"


def forward_story(scene: Scene, trajectory: Trajectory, index: int) -> str:
    """One sentence on body `index` in forward time: how it starts, what it hits, where it ends."""
    body, h = scene.bodies[index], body_history(scene, trajectory, index)
    parts: list[str] = []
    if h.start == "air_rest":
        parts.append(f"{body.noun} starts at rest in mid-air, about {h.height:.1f} m above the floor, and falls")
    elif h.start == "air_moving":
        parts.append(f"{body.noun} starts in mid-air about {h.height:.1f} m up, moving {direction(h.vx)}, and falls")
    elif h.start == "floor_moving":
        parts.append(
            f"{body.noun} starts {_moving_verb(body)} {direction(h.vx)} along the floor at about {h.speed:.1f} m/s"
        )
    else:
        parts.append(f"{body.noun} starts at rest on the floor")
    if h.floor_hits >= 2 and h.start.startswith("air"):
        shrinking = ", each bounce lower than the one before" if h.bounces_shrink else ""
        parts.append(f"bounces {h.floor_hits - 1} time{'s' if h.floor_hits > 2 else ''}{shrinking}")
    elif h.floor_hits == 1 and h.start.startswith("air"):
        parts.append("lands on the floor with hardly any bounce")
    if h.partners:
        parts.append("collides with " + join([scene.bodies[p].noun for p in h.partners]))
    if h.wall_hits:
        parts.append("bounces off the " + join(sorted(set(h.wall_hits))) + " wall")
    if h.rest_frame is None:
        parts.append("is still moving slowly at the end")
    elif h.rest_frame > 0:
        where = "on the floor" if h.rests_on_floor else "on top of another object"
        parts.append(f"comes to rest {where} after about {h.rest_frame / trajectory.fps:.1f} s")
    return join(parts) + "."


def reversed_story(scene: Scene, trajectory: Trajectory, index: int) -> str:
    """One sentence on body `index` as the time-reversed clip shows it."""
    body, h = scene.bodies[index], body_history(scene, trajectory, index)
    if h.start == "floor_rest" and not h.partners:
        return f"{body.noun} stays at rest on the floor throughout."
    parts = []
    if h.rest_frame is not None and h.rest_frame > 0:
        parts.append(f"{body.noun} sits still at first, then starts moving with nothing pushing it")
    else:
        parts.append(f"{body.noun} moves faster and faster with nothing pushing it")
    if h.floor_hits >= 2 and h.start.startswith("air") and h.bounces_shrink:
        parts.append("hops off the floor with each bounce higher than the one before")
    if h.start == "air_rest":
        parts.append(f"ends hanging motionless in mid-air about {h.height:.1f} m above the floor")
    elif h.start == "air_moving":
        parts.append(f"ends high in mid-air, about {h.height:.1f} m above the floor, having risen there on its own")
    elif h.start == "floor_moving":
        parts.append(f"ends {_moving_verb(body)} at about {h.speed:.1f} m/s, faster than at any time before")
    else:
        parts.append("stops dead the moment it meets " + scene.bodies[h.partners[0]].noun)
    return join(parts) + "."


def pendulum_amplitudes(scene: Scene, trajectory: Trajectory, index: int) -> tuple[float, float]:
    """Swing amplitude in degrees at the first and the last frame."""
    p = scene.pendulums[index]
    first = swing_amplitude(p, trajectory.thetas[0, index], trajectory.omegas[0, index])
    last = swing_amplitude(p, trajectory.thetas[-1, index], trajectory.omegas[-1, index])
    return first, last


def visible_objects(scene: Scene) -> list[str]:
    """Nouns of every body and pendulum in the scene."""
    return [b.noun for b in scene.bodies] + [p.noun for p in scene.pendulums]


def covered_fraction(scene: Scene, body: Body, x: float, y: float) -> float:
    """Fraction of the body's bounding box at (x, y) that the scene's occluders hide."""
    w, h = body.half_width, body.half_height
    area = 4 * w * h
    covered = 0.0
    for o in scene.occluders:
        dx = max(0.0, min(x + w, o.x1) - max(x - w, o.x0))
        dy = max(0.0, min(y + h, o.height) - max(y - h, 0.0))
        covered += dx * dy
    return min(1.0, covered / area)


def occlusion_series(scene: Scene, trajectory: Trajectory, index: int) -> np.ndarray:
    """Covered fraction of body `index` per frame; [frames]."""
    body = scene.bodies[index]
    return np.array(
        [covered_fraction(scene, body, *trajectory.positions[t, index]) for t in range(trajectory.n_frames)]
    )
