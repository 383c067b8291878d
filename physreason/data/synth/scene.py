"""A 2D side-view scene: bodies, pendulums and occluders in a walled arena, plus how it looks and is framed.

World units are metres and seconds, y points up, the floor is y = 0 and the arena's walls stand at
x = 0 and x = `Scene.width`. Appearance (colours, background, camera) is part of the scene so that a
scene seed fixes every pixel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

GRAVITY = 9.81  # m/s^2

BodyKind = Literal["ball", "box"]
RGB = tuple[int, int, int]

# Object colours carry names so that reasoning text can refer to "the red ball".
OBJECT_COLOURS: dict[str, RGB] = {
    "red": (205, 40, 40),
    "orange": (240, 135, 25),
    "yellow": (235, 205, 35),
    "green": (45, 165, 60),
    "teal": (25, 155, 150),
    "blue": (40, 80, 210),
    "purple": (135, 60, 175),
    "pink": (240, 115, 175),
    "brown": (125, 75, 35),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
}
# Backdrops (sky top, sky bottom) and floors; light and dark ones so no single brightness means "empty".
BACKDROPS: list[tuple[RGB, RGB]] = [
    ((170, 205, 240), (225, 238, 250)),
    ((238, 230, 205), (250, 246, 232)),
    ((200, 200, 205), (232, 232, 236)),
    ((200, 228, 200), (232, 245, 230)),
    ((215, 205, 235), (240, 234, 248)),
    ((30, 40, 70), (70, 85, 120)),
    ((45, 55, 50), (90, 100, 92)),
    ((80, 60, 60), (130, 110, 105)),
]
FLOORS: list[RGB] = [(150, 110, 70), (110, 110, 115), (60, 100, 60), (190, 170, 130), (70, 70, 80), (170, 90, 60)]
OCCLUDER_COLOURS: list[RGB] = [(120, 120, 130), (95, 125, 160), (165, 140, 100), (110, 90, 130), (90, 130, 110)]


@dataclass
class Body:
    """A rigid ball or axis-aligned box; position is its centre, velocity in m/s."""

    kind: BodyKind
    colour_name: str
    colour: RGB
    x: float
    y: float
    vx: float = 0.0
    vy: float = 0.0
    radius: float = 0.0  # balls
    half_w: float = 0.0  # boxes
    half_h: float = 0.0  # boxes
    restitution: float = 0.5  # fraction of normal speed kept in a bounce
    friction: float = 0.4  # Coulomb coefficient for sliding contacts
    rolling: float = 0.05  # rolling-resistance coefficient (balls on the floor)
    angle: float = 0.0  # rad; balls only, shows rolling
    omega: float = 0.0  # rad/s

    @property
    def mass(self) -> float:
        """Mass in kg, proportional to area (uniform density)."""
        if self.kind == "ball":
            return math.pi * self.radius**2 * 10.0
        return 4.0 * self.half_w * self.half_h * 10.0

    @property
    def half_height(self) -> float:
        """Distance from the centre to the bottom edge."""
        return self.radius if self.kind == "ball" else self.half_h

    @property
    def half_width(self) -> float:
        """Distance from the centre to the side edge."""
        return self.radius if self.kind == "ball" else self.half_w

    @property
    def noun(self) -> str:
        """How reasoning text names this body, e.g. 'the red ball'."""
        return f"the {self.colour_name} {self.kind}"


@dataclass
class Pendulum:
    """A rigid rod of `length` hanging from a pivot, a bob at its end; theta is measured from straight down."""

    colour_name: str
    colour: RGB
    pivot_x: float
    pivot_y: float
    length: float
    theta: float
    omega: float = 0.0
    damping: float = 0.6  # 1/s; air drag and pivot friction, so swings shrink
    bob_radius: float = 0.15

    @property
    def mass(self) -> float:
        """Mass of the bob in kg (same density as bodies)."""
        return math.pi * self.bob_radius**2 * 10.0

    @property
    def noun(self) -> str:
        """How reasoning text names this pendulum."""
        return f"the {self.colour_name} pendulum"


@dataclass
class Occluder:
    """An opaque screen standing on the floor in front of the bodies: it hides them but never touches them."""

    x0: float
    x1: float
    height: float
    colour: RGB
    stripe: RGB


@dataclass
class Camera:
    """Maps world metres to image pixels: `scale` px per metre, `x0` is the world x at the image's left edge."""

    width_px: int
    height_px: int
    scale: float
    x0: float
    floor_row: float  # image row of the floor line y = 0

    def to_px(self, x: float, y: float) -> tuple[float, float]:
        """World point to (column, row) in pixels."""
        return (x - self.x0) * self.scale, self.floor_row - y * self.scale

    @property
    def visible_height(self) -> float:
        """Metres of arena visible above the floor."""
        return self.floor_row / self.scale


@dataclass
class Appearance:
    """Colours and textures of everything that is not a moving object."""

    sky_top: RGB
    sky_bottom: RGB
    floor: RGB
    wall: RGB
    light_slope: float  # share of the sky gradient that runs sideways; its sign says which side is darker
    texture: Literal["plain", "stripes", "dots"]
    texture_seed: int


@dataclass
class Scene:
    """Everything needed to simulate and render one clip; bodies hold their initial state."""

    width: float
    camera: Camera
    appearance: Appearance
    bodies: list[Body] = field(default_factory=list)
    pendulums: list[Pendulum] = field(default_factory=list)
    occluders: list[Occluder] = field(default_factory=list)

    def copy(self) -> Scene:
        """A deep copy, so simulating never changes the initial state."""
        return dataclasses.replace(
            self,
            bodies=[dataclasses.replace(b) for b in self.bodies],
            pendulums=[dataclasses.replace(p) for p in self.pendulums],
            occluders=[dataclasses.replace(o) for o in self.occluders],
        )


def _jitter(rng: np.random.Generator, colour: RGB, amount: int) -> RGB:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in colour)  # type: ignore[return-value]


def _distance(a: RGB, b: RGB) -> float:
    return float(np.linalg.norm(np.subtract(a, b, dtype=np.float64)))


def random_appearance(rng: np.random.Generator) -> Appearance:
    """Draw a backdrop, floor and wall colour with small jitter, and a background texture."""
    top, bottom = BACKDROPS[rng.integers(len(BACKDROPS))]
    floor = FLOORS[rng.integers(len(FLOORS))]
    # Walls contrast with the backdrop, so each side of the arena is always identifiable.
    bright = sum(top) + sum(bottom) > 6 * 128
    wall = tuple(int(c * 0.55) if bright else int(c + (255 - c) * 0.5) for c in floor)
    return Appearance(
        sky_top=_jitter(rng, top, 12),
        sky_bottom=_jitter(rng, bottom, 12),
        floor=_jitter(rng, floor, 15),
        wall=wall,  # type: ignore[arg-type]
        light_slope=float(rng.uniform(0.2, 0.4) * rng.choice([-1.0, 1.0])),
        texture=("plain", "stripes", "dots")[rng.integers(3)],
        texture_seed=int(rng.integers(2**31)),
    )


def random_camera(rng: np.random.Generator, arena_width: float, width_px: int, height_px: int) -> Camera:
    """Frame the whole arena (walls included) with random margins and a random amount of visible floor."""
    margin_left, margin_right = rng.uniform(0.02, 0.12, size=2)
    scale = width_px * (1.0 - margin_left - margin_right) / arena_width
    floor_row = height_px * (1.0 - rng.uniform(0.08, 0.22))
    return Camera(width_px, height_px, float(scale), float(-margin_left * width_px / scale), float(floor_row))


def pick_object_colours(rng: np.random.Generator, appearance: Appearance, count: int) -> list[tuple[str, RGB]]:
    """Distinct named colours that stand out from the backdrop and floor, jittered a little."""
    background = (appearance.sky_top, appearance.sky_bottom, appearance.floor)
    names = [n for n, c in OBJECT_COLOURS.items() if min(_distance(c, b) for b in background) > 90]
    chosen = rng.choice(len(names), size=count, replace=False)
    return [(names[i], _jitter(rng, OBJECT_COLOURS[names[i]], 10)) for i in chosen]


def random_occluder(
    rng: np.random.Generator, x_centre: float, width: float, height: float, avoid: list[RGB]
) -> Occluder:
    """An opaque striped screen centred at `x_centre`, in a colour far from every colour in `avoid`."""
    options = [c for c in OCCLUDER_COLOURS if min(_distance(c, a) for a in avoid) > 60] or OCCLUDER_COLOURS
    colour = _jitter(rng, options[rng.integers(len(options))], 10)
    stripe = tuple(int(c * 0.8) for c in colour)
    return Occluder(x_centre - width / 2, x_centre + width / 2, height, colour, stripe)  # type: ignore[arg-type]
