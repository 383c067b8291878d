"""Random scene builders, one per kind of physical event: drops, slides, collisions, pendulums, occlusions.

Every builder takes a seeded `numpy.random.Generator` and returns a fresh `Scene` with random sizes,
colours, materials, backdrop and camera framing, so no single pixel cue identifies a kind or an answer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from physreason.data.synth.scene import (
    GRAVITY,
    Body,
    Pendulum,
    Scene,
    pick_object_colours,
    random_appearance,
    random_camera,
    random_occluder,
)

WIDTH_PX, HEIGHT_PX = 256, 192  # multiples of 32, so 2x2 patches stay aligned with 16x16 macroblocks
FPS = 8
N_FRAMES = 24  # 3 s: sampled at 4 fps a model sees 12 frames
DURATION = N_FRAMES / FPS


def _empty_scene(rng: np.random.Generator) -> Scene:
    width = float(rng.uniform(3.5, 6.0))
    return Scene(width, random_camera(rng, width, WIDTH_PX, HEIGHT_PX), random_appearance(rng))


def _random_body(rng: np.random.Generator, colour: tuple[str, tuple[int, int, int]], ball_share: float = 0.6) -> Body:
    name, rgb = colour
    if rng.random() < ball_share:
        return Body(
            "ball", name, rgb, 0.0, 0.0,
            radius=float(rng.uniform(0.14, 0.32)),
            restitution=float(rng.uniform(0.5, 0.85)),
            friction=float(rng.uniform(0.3, 0.7)),
            rolling=float(rng.uniform(0.1, 0.3)),
        )  # fmt: skip
    return Body(
        "box", name, rgb, 0.0, 0.0,
        half_w=float(rng.uniform(0.12, 0.32)),
        half_h=float(rng.uniform(0.12, 0.32)),
        restitution=float(rng.uniform(0.1, 0.35)),
        friction=float(rng.uniform(0.35, 0.7)),
    )  # fmt: skip


def _slots(rng: np.random.Generator, width: float, count: int) -> list[float]:
    """Centres of `count` equal lanes across the arena, jittered inside their lane, in random order."""
    lane = width / count
    centres = [(i + 0.5) * lane + rng.uniform(-0.2, 0.2) * lane for i in range(count)]
    rng.shuffle(centres)
    return centres


def build_drop(rng: np.random.Generator) -> Scene:
    """One to three balls or boxes released in mid-air: they fall, bounce lower each time and settle."""
    scene = _empty_scene(rng)
    count = int(rng.integers(1, 4))
    top = scene.camera.visible_height * 0.85
    for colour, x in zip(pick_object_colours(rng, scene.appearance, count), _slots(rng, scene.width, count)):
        body = _random_body(rng, colour, ball_share=0.75)
        body.x = x
        body.y = float(rng.uniform(max(0.45 * top, 0.8), top - body.half_height))
        body.vx = float(rng.uniform(-1.2, 1.2))
        scene.bodies.append(body)
    return scene


def build_slide(rng: np.random.Generator) -> Scene:
    """One to three bodies launched along the floor: friction or rolling resistance brings them to a stop."""
    scene = _empty_scene(rng)
    count = int(rng.integers(1, 4))
    for colour, x in zip(pick_object_colours(rng, scene.appearance, count), _slots(rng, scene.width, count)):
        body = _random_body(rng, colour)
        body.x, body.y = x, body.half_height
        # Fast enough to travel visibly; the material is set so that it stops well inside the clip.
        speed = float(rng.uniform(1.5, 4.0))
        coefficient = speed / (GRAVITY * DURATION * float(rng.uniform(0.6, 0.95)))
        body.rolling = body.friction = coefficient
        body.vx = speed * (1.0 if x < scene.width / 2 else -1.0) * (1.0 if rng.random() < 0.8 else -1.0)
        scene.bodies.append(body)
    return scene


def build_collide(rng: np.random.Generator) -> Scene:
    """A moving body strikes a group resting on the floor; the group scatters and everything slows to a stop."""
    scene = _empty_scene(rng)
    count = int(rng.integers(3, 5))
    colours = pick_object_colours(rng, scene.appearance, count)
    striker = _random_body(rng, colours[0], ball_share=0.8)
    striker.x, striker.y = 0.15 * scene.width + striker.half_width, striker.half_height
    striker.vx = float(rng.uniform(3.5, 6.0))
    scene.bodies.append(striker)
    x = float(rng.uniform(0.45, 0.6)) * scene.width
    for colour in colours[1:]:
        body = _random_body(rng, colour, ball_share=0.7)
        body.x, body.y = x + body.half_width, body.half_height
        x += 2 * body.half_width + float(rng.uniform(0.0, 0.25))
        scene.bodies.append(body)
    for body in scene.bodies:  # low resistance, so the scattering lasts a good part of the clip
        body.rolling = float(rng.uniform(0.04, 0.12))
        if body.kind == "box":
            body.friction = float(rng.uniform(0.08, 0.2))
    if rng.random() < 0.5:  # mirror, so the strike comes from either side
        for body in scene.bodies:
            body.x, body.vx = scene.width - body.x, -body.vx
    return scene


def build_pendulum(rng: np.random.Generator) -> Scene:
    """One or two damped pendulums released from a swing: each swing is smaller than the last."""
    scene = _empty_scene(rng)
    count = int(rng.integers(1, 3))
    pivot_y = scene.camera.visible_height * 0.92
    lane = scene.width / count
    for i, (name, rgb) in enumerate(pick_object_colours(rng, scene.appearance, count)):
        amplitude = float(rng.uniform(0.5, 1.1))
        max_length = min(pivot_y - 0.35, 0.45 * lane / np.sin(amplitude))
        length = float(rng.uniform(0.55, 1.0)) * max(max_length, 0.5)
        scene.pendulums.append(
            Pendulum(
                name, rgb,
                pivot_x=(i + 0.5) * lane,
                pivot_y=pivot_y,
                length=length,
                theta=amplitude * (1.0 if rng.random() < 0.5 else -1.0),
                omega=float(rng.uniform(-0.5, 0.5)),
                damping=float(rng.uniform(0.5, 1.1)),
                bob_radius=float(rng.uniform(0.1, 0.2)),
            )
        )  # fmt: skip
    return scene


def build_occlusion(rng: np.random.Generator) -> tuple[Scene, int]:
    """A body slides or rolls across the floor and passes behind a screen; returns the scene and that body's index.

    Low friction keeps it moving so that, unhindered, it comes out on the far side within the clip.
    Sometimes a swinging pendulum or a bouncing ball is added as a distractor.
    """
    scene = _empty_scene(rng)
    extras = int(rng.integers(0, 2))
    colours = pick_object_colours(rng, scene.appearance, 1 + extras)
    target = _random_body(rng, colours[0], ball_share=0.6)
    target.restitution = 0.3
    target.rolling, target.friction = float(rng.uniform(0.005, 0.03)), float(rng.uniform(0.02, 0.06))
    size = target.half_width
    screen_width = float(rng.uniform(max(0.7, 4.0 * size), max(1.3, 5.0 * size)))
    screen_height = 2 * target.half_height * float(rng.uniform(1.3, 2.2)) + 0.1
    centre = float(rng.uniform(0.42, 0.58)) * scene.width
    avoid = [scene.appearance.sky_top, scene.appearance.sky_bottom, scene.appearance.floor] + [c for _, c in colours]
    scene.occluders.append(random_occluder(rng, centre, screen_width, screen_height, avoid))
    target.x, target.y = float(rng.uniform(0.05, 0.2)) * scene.width + size, target.half_height
    # Distance to be fully out on the far side, covered in 55-80% of the clip.
    distance = centre + screen_width / 2 + size - target.x + 0.2
    decel = (target.rolling if target.kind == "ball" else target.friction) * GRAVITY
    target.vx = distance / (DURATION * float(rng.uniform(0.55, 0.8))) + decel * DURATION * 0.4
    scene.bodies.append(target)
    if extras:
        name, rgb = colours[1]
        if rng.random() < 0.5:
            pivot_y = scene.camera.visible_height * 0.92
            scene.pendulums.append(
                Pendulum(name, rgb, pivot_x=centre, pivot_y=pivot_y, length=float(rng.uniform(0.3, 0.6)) * pivot_y,
                         theta=float(rng.uniform(-1.0, 1.0)), damping=float(rng.uniform(0.1, 0.4)))
            )  # fmt: skip
        else:
            # A ball bouncing in place between the wall and the target's start, out of its way.
            ball = _random_body(rng, colours[1], ball_share=1.0)
            ball.x = ball.radius + 0.05
            ball.y = scene.camera.visible_height * float(rng.uniform(0.5, 0.8))
            target.x += 2 * ball.radius + 0.1
            scene.bodies.append(ball)
    if rng.random() < 0.5:  # mirror, so the target comes from either side
        for body in scene.bodies:
            body.x, body.vx = scene.width - body.x, -body.vx
        for p in scene.pendulums:
            p.pivot_x, p.theta = scene.width - p.pivot_x, -p.theta
        for o in scene.occluders:
            o.x0, o.x1 = scene.width - o.x1, scene.width - o.x0
    return scene, 0


# Scenes whose forward direction is unmistakable: energy visibly drains away.
IRREVERSIBLE_BUILDERS: dict[str, Callable[[np.random.Generator], Scene]] = {
    "drop": build_drop,
    "slide": build_slide,
    "collide": build_collide,
    "pendulum": build_pendulum,
}
