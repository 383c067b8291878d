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
rm -rf "$out" && mkdir -p "$out/wheels"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$out/wheels" \
  ray==2.60.0 msgpack==1.1.2 protobuf==6.33.1 requests==2.32.5 urllib3==2.5.0 charset-normalizer==3.4.4 certifi idna
(cd "$out/wheels" && tar -cf ../all.tar ./*.whl)
(cd "$out" && split -b 57M -d all.tar part_ && for f in part_*; do d=p${f#part_}; mkdir -p "$d"; mv "$f" "$d/part"; done)
size=$(stat -c %s "$out/all.tar"); sum=$(sha256sum "$out/all.tar" | cut -d' ' -f1)
last=$(ls "$out" | grep '^p[0-9]' | tail -1)
cat > "$out/$last/install.sh" <<INNER
set -e
test \$(stat -c %s /tmp/r.tar) -eq $size || { echo "r.tar is incomplete: send every part of .device-ray in order"; exit 1; }
echo "$sum  /tmp/r.tar" | sha256sum -c - >/dev/null
rm -rf /tmp/rw && mkdir -p /tmp/rw && tar -xf /tmp/r.tar -C /tmp/rw
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/rw/*.whl 2>&1 | grep -v -i warning || true
echo "ray installed in /tmp/site"
INNER
rm -rf "$out/wheels" "$out/all.tar"
du -sh "$out"/p*
