#!/usr/bin/env bash
# Prepare .device-wheels/ (git-ignored): the packages physreason needs on the GPU machine beyond its image (torch 2.11,
# transformers 5.17, numpy, safetensors, pyyaml, regex, tqdm, filelock, fsspec, psutil, packaging), for one `run` call.
#
# Usage, here in the project root:  bash tools/gpu_wheels.sh      (about 60 MiB; carry: [".device-wheels"])
# There, first in the command:      source .device-wheels/setup.sh
# setup.sh unpacks the wheels into /tmp/site (about 10 s) and sets PYTHONPATH=/tmp/site:<project> and PYTHONUNBUFFERED.
# The set stays under the 64 MiB a call carries with the tree: hf-xet (hub downloads) is left out, nothing is
# downloaded there. transformers 5.24 needs tokenizers >= 0.23.1, newer than the image's.
set -euo pipefail
out=.device-wheels
mkdir -p "$out"
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform any \
  -d "$out" \
  transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore anyio \
  idna h11 sniffio pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types annotated-doc \
  typing_extensions==4.16.0 typer==0.29.2 click==8.5.1 shellingham rich==15.0.0 markdown-it-py==4.3.0 mdurl \
  Pygments==2.21.0 tomli_w==1.2.0 peft==0.21.2 accelerate torchao==0.18.0 av==19.0.2 \
  2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
cat > "$out/setup.sh" <<'INNER'
# source .device-wheels/setup.sh   (from the project root, on the GPU machine)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device-wheels/*.whl \
  2>&1 | grep -v -i "warning" || true
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
INNER
du -sh "$out"
