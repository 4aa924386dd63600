#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that the GPU machines lack: Python 3.12, manylinux x86-64,
# no dependencies resolved (the machines already hold jax with CUDA, flax, optax, orbax-checkpoint, numpy,
# protobuf, absl-py, etils, PyYAML, psutil, ...). benchmarks/gpu_suite.py installs them from there with
# `pip install --no-index --no-deps --target` before its first step. Run it where PyPI can be reached:
#
#     scripts/gpu_wheels.sh [DEST]        # DEST defaults to .whl beside the code
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
packages=(
  ml-collections==1.1.0     # config files and overrides
  tensorboardX==2.6.5       # TensorBoard events of train.py
  grain==0.2.18             # the data loader's worker processes
  array-record==0.8.6       # grain's
  portpicker==1.6.0         # grain's
  importlib_resources==7.1.0  # etils[epath], grain's
  tokamax==0.0.17           # the grouped expert GEMM (jaxtron/ops/grouped.py); needs the machines' jax 0.11
  einshape==1.0             # tokamax's
  qwix==0.1.8               # tokamax's
  immutabledict==4.3.1      # tokamax's
  pydantic==2.14.4          # tokamax's
  pydantic-core==2.50.5     # pydantic's
  annotated-types==0.8.0    # pydantic's
  typing-inspection==0.4.5  # pydantic's
  typing-extensions==4.16.0  # pydantic's (newer than the machines')
  xprof==2.24.2             # tokamax imports its kernel-statistics tool
  fire==0.7.1               # xprof's
  termcolor==3.3.0          # fire's
  six==1.17.0               # xprof's (imported by tokamax)
  jaxtyping==0.3.11         # tokamax's type annotations
  wadler-lindig==0.1.8      # jaxtyping's
)
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any --dest "$dest" "${packages[@]}"
ls -1 "$dest"/*.whl
