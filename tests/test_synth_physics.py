"""The 2D simulator obeys the physics the synthetic tasks rely on, and rendering is deterministic."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from physreason.data.synth.render import render_frames
from physreason.data.synth.scene import GRAVITY, Appearance, Body, Camera, Occluder, Pendulum, Scene
from physreason.data.synth.simulate import simulate


def _scene(*bodies: Body, pendulums: tuple[Pendulum, ...] = (), occluders: tuple[Occluder, ...] = ()) -> Scene:
    appearance = Appearance((170, 205, 240), (225, 238, 250), (150, 110, 70), (80, 60, 40), 0.3, "plain", 0)
    camera = Camera(256, 192, scale=45.0, x0=-0.2, floor_row=165.0)
    return Scene(5.0, camera, appearance, list(bodies), list(pendulums), list(occluders))


def _ball(x: float, y: float, **kw) -> Body:
    return Body("ball", "red", (205, 40, 40), x, y, radius=kw.pop("radius", 0.2), **kw)


def test_dropped_ball_bounces_lower_each_time_and_settles():
    scene = _scene(_ball(2.5, 2.0, restitution=0.6, rolling=0.2))
    trajectory = simulate(scene, n_frames=40, fps=8)
    bounces = [e for e in trajectory.events if e.kind == "floor"]
    assert len(bounces) >= 3
    impact_speeds = [e.speed for e in bounces]
    assert all(later < earlier for earlier, later in itertools.pairwise(impact_speeds))
    assert impact_speeds[0] == pytest.approx(math.sqrt(2 * GRAVITY * 1.8), rel=0.03)  # free fall from 1.8 m
    assert trajectory.energy[-1] < 0.01 * trajectory.energy[0]
    assert trajectory.rest_frame(0) is not None
    assert trajectory.positions[-1, 0, 1] == pytest.approx(0.2, abs=1e-3)  # resting on the floor


def test_friction_stops_a_sliding_box_after_v_over_mu_g():
    box = Body("box", "blue", (40, 80, 210), 1.0, 0.2, vx=3.0, half_w=0.2, half_h=0.2, friction=0.4)
    trajectory = simulate(_scene(box), n_frames=200, fps=100, substeps=4)
    stop_time = trajectory.rest_frame(0) / 100
    assert stop_time == pytest.approx(3.0 / (0.4 * GRAVITY), rel=0.05)
    assert trajectory.positions[-1, 0, 0] - 1.0 == pytest.approx(3.0**2 / (2 * 0.4 * GRAVITY), rel=0.05)


def test_head_on_collision_conserves_horizontal_momentum():
    a = _ball(1.5, 3.0, vx=2.0, radius=0.2, restitution=1.0)
    b = _ball(2.5, 3.0, vx=-1.0, radius=0.3, restitution=1.0)
    trajectory = simulate(_scene(a, b), n_frames=40, fps=100, substeps=4)
    assert any(e.kind == "collision" for e in trajectory.events)
    masses = np.array([a.mass, b.mass])
    momentum = (trajectory.velocities[:, :, 0] * masses).sum(axis=1)  # [frames]
    assert np.allclose(momentum, momentum[0], rtol=1e-6)
    assert trajectory.velocities[-1, 0, 0] < 0 < trajectory.velocities[-1, 1, 0]  # they bounced apart


def test_undamped_pendulum_keeps_the_small_angle_period():
    length = 1.2
    pendulum = Pendulum("green", (45, 165, 60), 2.5, 3.0, length, theta=0.1, damping=0.0)
    trajectory = simulate(_scene(pendulums=(pendulum,)), n_frames=600, fps=100, substeps=4)
    theta = trajectory.thetas[:, 0]
    crossings = np.nonzero((theta[:-1] > 0) & (theta[1:] <= 0))[0]
    period = np.diff(crossings).mean() / 100
    assert period == pytest.approx(2 * math.pi * math.sqrt(length / GRAVITY), rel=0.02)
    assert trajectory.energy[-1] == pytest.approx(trajectory.energy[0], rel=0.02)


def test_damped_pendulum_loses_energy_every_frame():
    pendulum = Pendulum("green", (45, 165, 60), 2.5, 3.0, 1.0, theta=0.8, damping=0.8)
    trajectory = simulate(_scene(pendulums=(pendulum,)), n_frames=24, fps=8)
    assert np.all(np.diff(trajectory.energy) < 0)


def test_box_resting_on_a_box_stays_put():
    lower = Body("box", "blue", (40, 80, 210), 2.0, 0.25, half_w=0.3, half_h=0.25)
    upper = Body("box", "green", (45, 165, 60), 2.0, 0.75, half_w=0.2, half_h=0.25)
    trajectory = simulate(_scene(lower, upper), n_frames=24, fps=8)
    assert np.abs(trajectory.positions[-1] - trajectory.positions[0]).max() < 0.01


def test_occluder_hides_a_body_behind_it_in_the_render():
    screen = Occluder(2.0, 3.0, 1.0, (120, 120, 130), (100, 100, 110))
    behind, beside = _ball(2.5, 0.2), Body("ball", "yellow", (235, 205, 35), 4.0, 0.2, radius=0.2)
    scene = _scene(behind, beside, occluders=(screen,))
    frames = render_frames(scene, simulate(scene, n_frames=2, fps=8))
    red = np.all(np.abs(frames[0].astype(int) - (205, 40, 40)) <= 3, axis=-1).sum()
    yellow = np.all(np.abs(frames[0].astype(int) - (235, 205, 35)) <= 3, axis=-1).sum()
    assert red == 0 and yellow > 50


def test_simulation_leaves_the_initial_scene_unchanged():
    scene = _scene(_ball(2.5, 2.0))
    simulate(scene, n_frames=10, fps=8)
    assert (scene.bodies[0].y, scene.bodies[0].vy) == (2.0, 0.0)
