"""tether: asynchronous actor-learner RL post-training for language models.

This package is the core every process shares — config models (:mod:`tether.config`), contracts (the
trajectory type, the generated protobuf modules in :mod:`tether.v1`, the run folder and its records),
logging, metrics, spans, the embedded Redis — and, as the top layer above the buffer, the learner, the
rollout server and weight sync, the command line (:mod:`tether.commands`: the CLI, ``tether up`` and its
supervisor, the viewer, the planner, the tiny-model maker), which nothing below imports. It imports nothing
heavy at package level.
"""

__version__ = "0.1.0"
