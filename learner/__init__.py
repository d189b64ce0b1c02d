"""The FSDP2 learner: ``torchrun --nproc_per_node N -m learner --config FILE [--resume]``.

Modules: ``losses`` (pure loss functions), ``packing`` (samples, micro-batch plans, packed rows),
``logprobs`` (model forward, chunked entropy), ``varlen_attention`` (packed rows without flash-attn),
``parallelize`` (FSDP2 and levers), ``batch`` (groups to samples, rank-0 broadcast), ``trainer`` (one
step), ``checkpoint``, ``data`` and ``feed`` (rank 0's prompts and groups), ``telemetry`` and ``main``
(the process).
"""

import tether  # noqa: F401  (first: its process-wide gRPC fork rule, tether/__init__.py)
