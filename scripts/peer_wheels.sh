#!/usr/bin/env bash
# Downloads into DEST (default .whl/peer, ignored by git) the wheels that the peer benchmark
# (benchmarks/peer_maxtext.py: MaxText 0.2.5 training on synthetic data) needs on the GPU machines: Python 3.12,
# manylinux x86-64, no dependencies resolved. The machines already hold jax with CUDA, flax, optax,
# orbax-checkpoint, chex, tensorstore, numpy, PyYAML, protobuf, absl-py, etils, tensorboard (pillow, MarkupSafe)
# and psutil; jaxtron's own .whl/ (scripts/gpu_wheels.sh) holds the rest of what MaxText imports: tokamax, qwix,
# einshape, immutabledict, pydantic(-core), annotated-types, typing-inspection, typing-extensions, xprof, fire,
# termcolor, grain, array-record, portpicker, ml-collections. peer_maxtext.py installs DEST and .whl/ together,
# so this list holds only what jaxtron's lacks. Each pin is what MaxText's train module imports at load time
# (checked by importing and running it with these wheels alone on top of the machines' packages).
#
#     scripts/peer_wheels.sh [DEST]       # run where PyPI can be reached; DEST defaults to .whl/peer
#
# MaxText's wheel is 13.5 MB, 10.8 MB of it tokenizer files (maxtext/assets/tokenizers) that a synthetic-data
# run never opens; they are removed from the downloaded wheel (and from its RECORD) so that the source tree,
# jaxtron's wheels (~41 MiB) and these fit one 64 MiB transfer. PEER_KEEP_TOKENIZERS=1 keeps the wheel whole.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl/peer}
packages=(
  maxtext==0.2.5              # the peer trainer (python -m maxtext.trainers.pre_train.train)
  aqtp==0.9.0                 # maxtext.layers.quantizations / moe / inference.kvcache (module level)
  omegaconf==2.4.0            # maxtext.configs.pyconfig
  jinja2==3.1.6               # maxtext.configs.types
  drjax==0.2.1                # maxtext.utils.diloco_sharding
  cloudpickle==3.1.3          # grain's
  pathwaysutils==0.1.13       # imported by maxtext's train.py and utils/elastic_utils.py
  fastapi==0.165.0            # pathwaysutils.profiling
  starlette==1.10.0           # fastapi's
  annotated-doc==0.0.7        # fastapi's
  opentelemetry-api==1.45.2   # fastapi's
  anyio==4.16.0               # starlette's
  idna==3.20                  # anyio's, requests'
  uvicorn==0.54.0             # pathwaysutils.profiling
  click==8.5.1                # uvicorn's
  requests==2.34.2            # pathwaysutils.profiling
  urllib3==2.8.0              # requests'
  certifi==2026.10.19.post1   # requests'
  charset-normalizer==3.5.3   # requests'
)
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any --dest "$dest" "${packages[@]}"
if [[ "${PEER_KEEP_TOKENIZERS:-0}" != 1 ]]; then
  python3 - "$dest"/maxtext-0.2.5-py3-none-any.whl <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
drop = "maxtext/assets/tokenizers/"
with zipfile.ZipFile(path) as src:
    if not any(n.startswith(drop) for n in src.namelist()):
        sys.exit(0)  # already slimmed
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(drop.encode()))
            out.writestr(info, data)
os.replace(tmp, path)
print(f"{os.path.basename(path)}: removed {drop} ({os.path.getsize(path) / 2**20:.1f} MiB left)")
EOF
fi
ls -1 "$dest"/*.whl
du -ch "$dest"/*.whl | tail -1
