"""Fixed-step rigid-body simulation of a `Scene`: gravity, bounces, friction, rolling, collisions, pendulums.

Semi-implicit Euler with impulse-based contacts. A contact bounces with the body's restitution only
when the approach speed is above `BOUNCE_MIN_SPEED`; slower contacts stick, so bodies settle instead of
jittering. Friction and rolling resistance act through the normal impulse, so a body resting on the
floor decelerates at mu * g as Coulomb friction says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from physreason.data.synth.scene import GRAVITY, Body, Pendulum, Scene

BOUNCE_MIN_SPEED = 0.4  # m/s: slower impacts do not bounce
EVENT_MIN_SPEED = 0.5  # m/s: slower impacts are not worth narrating
REST_SPEED = 0.05  # m/s: below this a body counts as at rest
POSITION_CORRECTION = 0.8  # fraction of an overlap removed per step


@dataclass
class Event:
    """Something a viewer would notice, in forward time: a bounce on the floor or a wall, or a collision."""

    time: float  # s from the start of the clip
    kind: str  # "floor", "wall" or "collision"
    body: int  # index into Scene.bodies
    other: int | None = None  # the other body of a collision
    speed: float = 0.0  # m/s approach speed


@dataclass
class Trajectory:
    """Per-frame states of every body and pendulum, the scene's mechanical energy, and notable events."""

    fps: float
    positions: np.ndarray  # [frames, bodies, 2] m
    velocities: np.ndarray  # [frames, bodies, 2] m/s
    angles: np.ndarray  # [frames, bodies] rad
    thetas: np.ndarray  # [frames, pendulums] rad from straight down
    omegas: np.ndarray  # [frames, pendulums] rad/s
    energy: np.ndarray  # [frames] J: kinetic + potential (above resting on the floor)
    events: list[Event] = field(default_factory=list)

    @property
    def n_frames(self) -> int:
        """Number of rendered frames."""
        return int(self.positions.shape[0])

    def speeds(self) -> np.ndarray:
        """Speed of each body per frame; [frames, bodies] m/s."""
        return np.linalg.norm(self.velocities, axis=-1)

    def rest_frame(self, body: int) -> int | None:
        """First frame from which the body stays at rest to the end, or None if it is still moving."""
        moving = np.nonzero(self.speeds()[:, body] >= REST_SPEED)[0]
        if moving.size == 0:
            return 0
        last = int(moving[-1]) + 1
        return last if last < self.n_frames else None


def mechanical_energy(scene: Scene) -> float:
    """Kinetic plus potential energy in J; a body resting on the floor and a hanging bob have zero potential."""
    energy = 0.0
    for b in scene.bodies:
        energy += 0.5 * b.mass * (b.vx**2 + b.vy**2) + b.mass * GRAVITY * (b.y - b.half_height)
    for p in scene.pendulums:
        energy += p.mass * (0.5 * (p.length * p.omega) ** 2 + GRAVITY * p.length * (1.0 - math.cos(p.theta)))
    return energy


def simulate(scene: Scene, n_frames: int, fps: float, substeps: int = 30) -> Trajectory:
    """Run the scene for `n_frames` frames of 1/fps s, `substeps` fixed steps each; frame 0 is the initial state."""
    state = scene.copy()
    dt = 1.0 / (fps * substeps)
    nb, npend = len(state.bodies), len(state.pendulums)
    positions = np.zeros((n_frames, nb, 2))
    velocities = np.zeros((n_frames, nb, 2))
    angles = np.zeros((n_frames, nb))
    thetas = np.zeros((n_frames, npend))
    omegas = np.zeros((n_frames, npend))
    energy = np.zeros(n_frames)
    events: list[Event] = []
    touching: set[tuple[int, int | str]] = set()  # contacts of the previous step, so one impact is one event

    for frame in range(n_frames):
        for i, b in enumerate(state.bodies):
            positions[frame, i] = b.x, b.y
            velocities[frame, i] = b.vx, b.vy
            angles[frame, i] = b.angle
        thetas[frame] = [p.theta for p in state.pendulums]
        omegas[frame] = [p.omega for p in state.pendulums]
        energy[frame] = mechanical_energy(state)
        if frame == n_frames - 1:
            break
        for sub in range(substeps):
            time = (frame + (sub + 1) / substeps) / fps
            touching = _step(state, dt, time, events, touching)
    return Trajectory(fps, positions, velocities, angles, thetas, omegas, energy, events)


def _step(
    state: Scene, dt: float, time: float, events: list[Event], touching: set[tuple[int, int | str]]
) -> set[tuple[int, int | str]]:
    for b in state.bodies:
        b.vy -= GRAVITY * dt
        b.x += b.vx * dt
        b.y += b.vy * dt
        b.angle += b.omega * dt
    for p in state.pendulums:
        _step_pendulum(p, dt)
    now: set[tuple[int, int | str]] = set()
    for i, b in enumerate(state.bodies):
        speed = _floor_contact(b)
        if speed is not None:
            now.add((i, "floor"))
            if speed > EVENT_MIN_SPEED and (i, "floor") not in touching:
                events.append(Event(time, "floor", i, speed=speed))
        speed = _wall_contact(b, state.width)
        if speed is not None:
            now.add((i, "wall"))
            if speed > EVENT_MIN_SPEED and (i, "wall") not in touching:
                events.append(Event(time, "wall", i, speed=speed))
    # Two passes let a stack pass an impulse down to the floor within one step.
    for _ in range(2):
        for i in range(len(state.bodies)):
            for j in range(i + 1, len(state.bodies)):
                speed = _resolve_pair(state.bodies[i], state.bodies[j])
                if speed is not None:
                    now.add((i, j))
                    if speed > EVENT_MIN_SPEED and (i, j) not in touching:
                        events.append(Event(time, "collision", i, other=j, speed=speed))
                        touching = touching | {(i, j)}
    return now


def _step_pendulum(p: Pendulum, dt: float) -> None:
    p.omega += (-(GRAVITY / p.length) * math.sin(p.theta) - p.damping * p.omega) * dt
    p.theta += p.omega * dt


def _bounce(approach: float, restitution: float) -> float:
    """Separating speed after an impact at `approach` m/s."""
    return restitution * approach if approach > BOUNCE_MIN_SPEED else 0.0


def _floor_contact(b: Body) -> float | None:
    """Push the body out of the floor; bounce, rub and roll it; return the approach speed if it touches."""
    depth = b.half_height - b.y
    if depth < 0:
        return None
    b.y += depth
    approach = max(-b.vy, 0.0)
    b.vy = _bounce(approach, b.restitution)
    normal_dv = approach + b.vy  # normal impulse per unit mass
    coefficient = b.rolling if b.kind == "ball" else b.friction
    b.vx -= math.copysign(min(abs(b.vx), coefficient * normal_dv), b.vx)
    if b.kind == "ball":
        b.omega = -b.vx / b.radius  # rolls without slipping: moving right turns it clockwise
    return approach


def _wall_contact(b: Body, width: float) -> float | None:
    """Keep the body between the walls, bouncing it off them; return the approach speed if it touches."""
    left = b.half_width - b.x
    right = b.x + b.half_width - width
    if left >= 0:
        b.x += left
        approach = max(-b.vx, 0.0)
        b.vx = _bounce(approach, b.restitution)
        return approach
    if right >= 0:
        b.x -= right
        approach = max(b.vx, 0.0)
        b.vx = -_bounce(approach, b.restitution)
        return approach
    return None


def _contact_normal(a: Body, b: Body) -> tuple[float, float, float] | None:
    """Unit normal pointing from a to b and the overlap depth, or None if they do not touch."""
    if a.kind == "ball" and b.kind == "ball":
        dx, dy = b.x - a.x, b.y - a.y
        dist = math.hypot(dx, dy)
        depth = a.radius + b.radius - dist
        if depth <= 0:
            return None
        return (dx / dist, dy / dist, depth) if dist > 1e-9 else (0.0, 1.0, depth)
    if a.kind == "box" and b.kind == "box":
        dx, dy = b.x - a.x, b.y - a.y
        over_x = a.half_w + b.half_w - abs(dx)
        over_y = a.half_h + b.half_h - abs(dy)
        if over_x <= 0 or over_y <= 0:
            return None
        if over_x < over_y:
            return math.copysign(1.0, dx), 0.0, over_x
        return 0.0, math.copysign(1.0, dy), over_y
    if a.kind == "box":
        flipped = _contact_normal(b, a)
        return None if flipped is None else (-flipped[0], -flipped[1], flipped[2])
    # a is a ball, b a box: nearest point of the box to the ball's centre.
    cx = min(max(a.x, b.x - b.half_w), b.x + b.half_w)
    cy = min(max(a.y, b.y - b.half_h), b.y + b.half_h)
    dx, dy = cx - a.x, cy - a.y
    dist = math.hypot(dx, dy)
    if dist > 1e-9:
        depth = a.radius - dist
        return None if depth <= 0 else (dx / dist, dy / dist, depth)
    # The centre is inside the box: leave along the shallowest axis.
    over_x = b.half_w + a.radius - abs(b.x - a.x)
    over_y = b.half_h + a.radius - abs(b.y - a.y)
    if over_x < over_y:
        return math.copysign(1.0, b.x - a.x), 0.0, over_x
    return 0.0, math.copysign(1.0, b.y - a.y), over_y


def _resolve_pair(a: Body, b: Body) -> float | None:
    """Separate two overlapping bodies and exchange normal and friction impulses; return the approach speed."""
    contact = _contact_normal(a, b)
    if contact is None:
        return None
    nx, ny, depth = contact
    inv_a, inv_b = 1.0 / a.mass, 1.0 / b.mass
    share = POSITION_CORRECTION * depth / (inv_a + inv_b)
    a.x -= nx * share * inv_a
    a.y -= ny * share * inv_a
    b.x += nx * share * inv_b
    b.y += ny * share * inv_b
    approach = -((b.vx - a.vx) * nx + (b.vy - a.vy) * ny)
    if approach <= 0:
        return 0.0
    jn = (approach + _bounce(approach, min(a.restitution, b.restitution))) / (inv_a + inv_b)
    tx, ty = -ny, nx
    slip = (b.vx - a.vx) * tx + (b.vy - a.vy) * ty
    limit = math.sqrt(a.friction * b.friction) * jn
    jt = max(-limit, min(limit, -slip / (inv_a + inv_b)))
    a.vx -= (jn * nx + jt * tx) * inv_a
    a.vy -= (jn * ny + jt * ty) * inv_a
    b.vx += (jn * nx + jt * tx) * inv_b
    b.vy += (jn * ny + jt * ty) * inv_b
    return approach
