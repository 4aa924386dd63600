# The environment every jaxtron process starts with on a GPU cluster; sourced by train.sbatch.
# Each setting has its reason next to it. Override any of them by exporting it before sbatch.

# JAX takes 75% of GPU memory by default; the run's own memory check (check_fits) already refuses a state
# that cannot fit, so let the step use almost all of it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# NCCL prints its setup and errors once per process; INFO floods the job log with every ring.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# XLA flags for the GPU step are kept in one place: add them here with the measurement that justifies them.
export XLA_FLAGS=${XLA_FLAGS:-}
# Python output reaches the job log as it is written, so the last lines before a failure are not lost.
export PYTHONUNBUFFERED=1
