# The environment every jaxtron process starts with on a GPU cluster; sourced by train.sbatch.
# The settings and the reason for each live in jaxtron/gpu/preset.py, the one preset for all GPU runs;
# a variable exported before sbatch keeps its value (XLA_FLAGS: appended after the preset's flags).
# `python -m jaxtron gpu-preset --check` checks the XLA flags against the installed jaxlib.
jaxtron_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
eval "$(PYTHONPATH="$jaxtron_root${PYTHONPATH:+:$PYTHONPATH}" python -m jaxtron gpu-preset)" \
  || { echo "error: could not read the GPU preset (python -m jaxtron gpu-preset) from $jaxtron_root." >&2; exit 2; }
