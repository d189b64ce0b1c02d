"""Weight sync: new policy weights from the FSDP2 learner to the rollout fleet (issue 6).

``sender.WeightSender`` (learner, every rank) → ``transport`` (gloo | nccl | filesystem) →
``receiver.WeightReceiver`` (rollout server: the handshake) → ``inbox`` (the transport's receiving end:
bytes in, named tensors out) → the engine's own ``load_weights`` (``loading.WeightLoader``; the engines
implement it in ``rollout_server/engines/``). Weight sync never imports or inspects an engine. See
weight_sync/README.md for the handshake, failure handling and measured costs. Importing this package
imports nothing heavy; import the submodule you need.
"""

import tether  # noqa: F401  (first: its process-wide gRPC fork rule, tether/__init__.py)
