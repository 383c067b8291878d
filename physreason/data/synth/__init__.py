"""Procedural intuitive-physics data: a small 2D physics renderer and the arrow-of-time, spatial-puzzle
and object-permanence tasks of Cosmos-Reason1, written as clips with benchmark and SFT records.

`generate.generate_task` writes a data set; each task module's `make_sample(seed, slot)` builds one sample.
"""
