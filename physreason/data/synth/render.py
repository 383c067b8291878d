"""Draw a simulated scene into RGB frames with PIL: backdrop, floor, walls, bodies, pendulums, occluders on top.

Frames are drawn at twice the target size and box-filtered down, so edges are anti-aliased and small
motions stay visible between frames.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from physreason.data.synth.scene import RGB, Appearance, Camera, Scene
from physreason.data.synth.simulate import Trajectory

SUPERSAMPLE = 2


def _shade(colour: RGB, factor: float) -> RGB:
    return tuple(int(min(255, max(0, c * factor))) for c in colour)  # type: ignore[return-value]


def _backdrop(appearance: Appearance, camera: Camera, width: float) -> Image.Image:
    """The static part of every frame: sky gradient with texture, floor, and the two walls."""
    s = SUPERSAMPLE
    w, h = camera.width_px * s, camera.height_px * s
    # The gradient also runs sideways, as under light from one side, so the left and right halves differ.
    tilt = abs(appearance.light_slope)
    across = np.linspace(0.0, 1.0, w) if appearance.light_slope > 0 else np.linspace(1.0, 0.0, w)
    ramp = (1 - tilt) * np.linspace(0.0, 1.0, h)[:, None, None] + tilt * across[None, :, None]  # [h, w, 1]
    pixels = (1 - ramp) * np.array(appearance.sky_top) + ramp * np.array(appearance.sky_bottom)  # [h, w, 3]
    rng = np.random.default_rng(appearance.texture_seed)
    if appearance.texture == "stripes":
        period = int(rng.integers(12, 40)) * s
        pixels[:, (np.arange(w) // period) % 2 == 1] *= 0.93
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    if appearance.texture == "dots":
        for _ in range(int(rng.integers(15, 40))):
            cx, cy, r = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(2, 6)) * s
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=_shade(tuple(pixels[cy, cx].astype(int)), 0.9))
    floor_row = camera.floor_row * s
    draw.rectangle([0, floor_row, w, h], fill=appearance.floor)
    draw.line([0, floor_row, w, floor_row], fill=_shade(appearance.floor, 0.7), width=s)
    thickness = max(2 * s, int(0.08 * camera.scale * s))
    for x in (0.0, width):
        col = camera.to_px(x, 0.0)[0] * s
        left = col - thickness if x == 0.0 else col
        draw.rectangle([left, 0, left + thickness, floor_row], fill=appearance.wall)
    return image


def render_frames(scene: Scene, trajectory: Trajectory, hidden: np.ndarray | None = None) -> np.ndarray:
    """Render every frame of the trajectory; `hidden[frame, body]` True leaves that body out. Returns [T, H, W, 3] uint8."""
    camera, s = scene.camera, SUPERSAMPLE
    backdrop = _backdrop(scene.appearance, camera, scene.width)
    frames = np.empty((trajectory.n_frames, camera.height_px, camera.width_px, 3), dtype=np.uint8)

    def px(x: float, y: float) -> tuple[float, float]:
        col, row = camera.to_px(x, y)
        return col * s, row * s

    for t in range(trajectory.n_frames):
        image = backdrop.copy()
        draw = ImageDraw.Draw(image)
        for p, theta in zip(scene.pendulums, trajectory.thetas[t]):
            bob = (p.pivot_x + p.length * math.sin(theta), p.pivot_y - p.length * math.cos(theta))
            pivot_px, bob_px = px(p.pivot_x, p.pivot_y), px(*bob)
            mount = 0.12 * camera.scale * s
            draw.rectangle(
                [pivot_px[0] - mount, pivot_px[1] - mount / 2, pivot_px[0] + mount, pivot_px[1]],
                fill=scene.appearance.wall,
            )
            draw.line([pivot_px, bob_px], fill=scene.appearance.wall, width=max(s, int(0.025 * camera.scale * s)))
            r = p.bob_radius * camera.scale * s
            draw.ellipse(
                [bob_px[0] - r, bob_px[1] - r, bob_px[0] + r, bob_px[1] + r],
                fill=p.colour,
                outline=_shade(p.colour, 0.6),
                width=s,
            )
        for i, b in enumerate(scene.bodies):
            if hidden is not None and hidden[t, i]:
                continue
            cx, cy = px(*trajectory.positions[t, i])
            outline = _shade(b.colour, 0.6)
            if b.kind == "ball":
                r = b.radius * camera.scale * s
                draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=b.colour, outline=outline, width=s)
                # A stripe through the centre makes rolling visible.
                angle = trajectory.angles[t, i]
                dx, dy = 0.8 * r * math.cos(angle), -0.8 * r * math.sin(angle)
                draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=outline, width=max(s, int(r / 5)))
            else:
                hw, hh = b.half_w * camera.scale * s, b.half_h * camera.scale * s
                draw.rectangle([cx - hw, cy - hh, cx + hw, cy + hh], fill=b.colour, outline=outline, width=s)
                inset = 0.3 * min(hw, hh)
                draw.rectangle(
                    [cx - hw + inset, cy - hh + inset, cx + hw - inset, cy + hh - inset], outline=outline, width=s
                )
        for o in scene.occluders:
            left, top = px(o.x0, o.height)
            right, bottom = px(o.x1, 0.0)
            draw.rectangle([left, top, right, bottom], fill=o.colour, outline=_shade(o.colour, 0.6), width=s)
            step = max(4 * s, int((right - left) / 6))
            for col in np.arange(left + step, right - step / 2, step):
                draw.line([col, top + s, col, bottom - s], fill=o.stripe, width=s)
        frames[t] = np.asarray(image.reduce(SUPERSAMPLE))
    return frames
