#!/usr/bin/env bash
# Prepare TRL 1.16.0 and datasets 5.2.0 (Python 3.12, manylinux) for the GPU machine, which has no package access:
# the two wheels and the dependencies that neither .device-wheels (tools/gpu_wheels.sh: accelerate, huggingface_hub,
# transformers 5.24, rich) nor the vLLM set (../shared/gpu/vllm-wheels.sh: dill 0.4.1) carries, split into parts of
# 57 MiB so each part travels in its own `run` call beside the tree (64 MiB in all). bench/grpo_vs_trl.py needs them.
# From the wheels' Requires-Dist: trl needs accelerate, datasets, huggingface_hub, jinja2, numpy, packaging, pandas,
# psutil, pyarrow, pyyaml, transformers; datasets needs filelock, numpy, pyarrow>=24, dill<0.4.2, pandas, tqdm, xxhash,
# multiprocess<0.70.20, fsspec<=2026.9.0, huggingface-hub>=1.31, packaging, pyyaml. The image names pandas, pyarrow,
# xxhash, fsspec and python-dateutil too, at versions not read here, so the pins that ran with TRL there on 2026-11-24
# travel (bench/RESULTS.md "GRPO against TRL 1.16"); they come first on PYTHONPATH. python-dateutil 4 needs tzdata.
#
# Usage, here in the project root:  bash tools/trl_wheels.sh      (makes .device-trl/, git-ignored; about 67 MiB)
# There, each part in its own call, in order, within 30 s of the last (the same machine keeps /tmp):
#   first:  rm -f /tmp/t.tar; cat .device-trl/p00/part >> /tmp/t.tar          carry [".device-trl/p00"]
#   last:   cat .device-trl/p01/part >> /tmp/t.tar && bash .device-trl/p01/install.sh && <your command>
# install.sh checks the tar's size and sha256 and installs into /tmp/site (beside vLLM and .device-wheels). Run it
# after the vLLM set's install.sh, which empties /tmp/site.
set -euo pipefail
out=.device-trl
source "$(dirname "$0")/wheel_parts.sh"
download_wheels "$out" trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 multiprocess==0.70.19 \
  xxhash==4.1.0 fsspec==2026.9.0 python-dateutil==4.0.0 tzdata==2026.6
pack_parts "$out" /tmp/t.tar "trl and datasets" 'test -d /tmp/site/trl && test -d /tmp/site/datasets && test -d /tmp/site/pyarrow || { echo "trl, datasets or pyarrow missing from /tmp/site"; exit 1; }'
