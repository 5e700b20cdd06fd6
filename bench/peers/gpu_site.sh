#!/bin/bash
# Run here, from the repo root: writes .trl/ (git-ignored), the wheels TRL's side of bench/peers/gpu.py needs on the
# H200 beyond its image and the vLLM / Ray / DeepSpeed sites of shared/gpu (device-setup.sh): TRL 1.16.0 (vLLM
# 0.22-0.31 and transformers >= 4.56.2: the image's 5.17.0 and the carried vLLM 0.26.0 pass), datasets 5.2.0 and
# multiprocess 0.70.19 (not in the image; their dill 0.4.1 is in the vLLM site) and pyarrow 26.0.1 (datasets 5.2 wants
# >= 24; the image's version is not recorded; PYARROW=0 leaves it out: 1.7 MB instead of ~54 MiB). accelerate, pandas,
# xxhash, fsspec, huggingface-hub, jinja2, psutil, pyyaml, requests and aiohttp are the image's
# (/work/.library/device/KINDS.md's list). On the device: carry .trl and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl/site-packages .trl/*.whl
# bench/peers/gpu.py puts /tmp/trl/site-packages first (a path holding "site-packages": dill pickles modules from any other folder by value) on the TRL process's PYTHONPATH (never on our side's).
set -eu
dest=${DEST:-.trl}
if [ "$dest" = .trl ]; then
  ex="$(git rev-parse --git-common-dir)/info/exclude"; grep -qx "/.trl/" "$ex" 2>/dev/null || echo "/.trl/" >> "$ex"
fi
rm -rf "$dest" && mkdir -p "$dest"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
pkgs="trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19"
[ "${PYARROW:-1}" = 0 ] || pkgs="$pkgs pyarrow==26.0.1"
python3 -m pip download -q --no-deps $plat -d "$dest" $pkgs
ls -la "$dest"; du -sh "$dest"
