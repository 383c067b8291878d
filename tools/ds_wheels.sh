#!/usr/bin/env bash
# Prepare .device-ds/ (git-ignored, about 3 MiB): DeepSpeed and what it needs beyond the GPU image and .device-wheels,
# for bench/host_adamw.py's anchor row on a GPU machine (physreason itself never imports DeepSpeed). It travels apart
# from .device-wheels, which fills the 64 MiB a call carries with the tree: carry [".device-ds"] in a call of its own
# that copies the wheels to /tmp/ds, then install them with the .device-wheels set:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/ds/*.whl
# PyPI has DeepSpeed's source alone; it builds a pure-Python wheel here, and its cpu_adam op compiles on the GPU
# machine at first use (ninja from /tmp/site/bin, which setup.sh puts on PATH).
set -euo pipefail
out=.device-ds
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$out" hjson ninja py-cpuinfo msgpack einops 2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
python3 -m pip wheel -q --no-deps -w "$out" deepspeed==0.19.8 2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
du -sh "$out"
