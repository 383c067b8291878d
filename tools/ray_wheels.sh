#!/usr/bin/env bash
# Prepare Ray 2.60.0 (Python 3.12, manylinux) for the GPU machine, which has no package access: the wheel and the
# dependencies neither the GPU image nor the vLLM set (../shared/gpu/vllm-wheels.sh) has, split into parts of 57 MiB
# so each part travels in its own `run` call beside the tree (64 MiB in all).
#
# Usage, here in the project root:  bash tools/ray_wheels.sh      (makes .device-ray/, git-ignored; about 80 MiB)
# There, each part in its own call, in order, within 30 s of the last (the same machine keeps /tmp):
#   first:  rm -f /tmp/r.tar; cat .device-ray/p00/part >> /tmp/r.tar          carry [".device-ray/p00"]
#   last:   cat .device-ray/p01/part >> /tmp/r.tar && bash .device-ray/p01/install.sh && <your command>
# install.sh checks the tar's size and sha256 and installs into /tmp/site (beside vLLM and .device-wheels).
set -euo pipefail
out=.device-ray
source "$(dirname "$0")/wheel_parts.sh"
download_wheels "$out" ray==2.60.0 msgpack==1.1.2 protobuf==6.33.1 requests==2.32.5 \
  urllib3==2.5.0 charset-normalizer==3.4.4 certifi idna
pack_parts "$out" /tmp/r.tar "ray"
