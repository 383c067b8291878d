"""The learning experiments: a small model trained from scratch on `data synth` clips, SFT then GRPO, and its held-out
table, to check that training learns on this machine (`physreason experiment`, docs/experiments.md).

- intuitive_physics: the letter tasks (arrow of time, spatial puzzle, object permanence);
- grounding: the JSON-answer tasks (grounding, temporal localization), GRPO against its SFT control;
- common: what both share (the recipe's knobs, model, tower pre-training, stage settings, seeds, results files);
- tower: the vision tower's pre-training on its own (`python -m physreason.experiments.tower`);
- probe: a small 3D CNN on the same frames, telling unlearnable clips from a model that fails to learn them.
"""
