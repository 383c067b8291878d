#!/usr/bin/env bash
# Prepare vLLM for the GPU machine in parts that travel beside the tree: ../shared/gpu/vllm-wheels.sh downloads the
# pinned wheel set (vLLM 0.26.0 and what the GPU image lacks) and splits it in 62 MiB parts, which with the tree exceed
# the 64 MiB a call carries; this re-packs the same wheels in 57 MiB parts (tools/wheel_parts.sh: .device-vllm/p00..p06,
# install.sh in the last, checking /tmp/v.tar's size and sha256 and installing into /tmp/site).
#
# Usage, here in the project root:  bash tools/vllm_wheels.sh      (makes .device-vllm/, git-ignored; about 370 MiB)
# There, each part in its own call, in order, within 30 s of the last (bench/PENDING.md section 1):
#   first:  rm -f /tmp/v.tar; cat .device-vllm/p00/part >> /tmp/v.tar          carry [".device-vllm/p00"]
#   last:   cat .device-vllm/p06/part >> /tmp/v.tar && bash .device-vllm/p06/install.sh && <your command>
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu/vllm-wheels.sh
rm -rf .device-vllm/p?? .device-vllm/install.sh
source tools/wheel_parts.sh
pack_parts .device-vllm /tmp/v.tar vLLM
