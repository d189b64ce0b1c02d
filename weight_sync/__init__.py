"""Weight sync: new policy weights from the FSDP2 learner to the rollout fleet (issue 6).

``sender.WeightSender`` (learner, every rank) → ``transport`` (gloo | nccl | filesystem) →
``receiver.WeightReceiver`` (rollout server) → the engine (``targets``; ``vllm_worker`` inside vLLM).
See weight_sync/README.md for the handshake, failure handling and measured costs. Importing this
package imports nothing heavy; import the submodule you need.
"""
