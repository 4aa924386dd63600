"""The links between the GPUs of an HGX H100 or H200 machine, as NCCL's collectives of large messages reach them.

- ``NVLINK_BANDWIDTH``: bus bandwidth inside a node (NVLink 4 moves 450 GB/s per direction per GPU; assumed 80% of
  it is reached by ring/NVLS collectives). ``NVLINK5_BANDWIDTH``: Blackwell's NVLink 5, twice that, inside an
  HGX B200 node or a GB200 NVL72 rack's one NVLink domain.
- ``NETWORK_BANDWIDTH``: bus bandwidth per GPU between nodes (one 400 Gb/s InfiniBand NIC per GPU: 50 GB/s per
  direction; assumed 80% of it is reached).
- ``GPUS_PER_NODE``: the GPUs of one node.

The planner prices collectives with them (``planning/gpus.py``), and so does the latency-hiding scheduler's profile
(``metrics/schedule.py``).
"""

NVLINK_BANDWIDTH = 0.8 * 450e9
# NVLink 5 (B200, GB200): 1.8 TB/s a GPU, 900 GB/s per direction, 80% of it assumed reached as NVLink 4's
NVLINK5_BANDWIDTH = 0.8 * 900e9
NETWORK_BANDWIDTH = 0.8 * 50e9
GPUS_PER_NODE = 8
