"""tether: asynchronous actor-learner RL post-training for language models.

This package holds what every process shares: config models (:mod:`tether.config`), the CLI, logging
and metrics, the generated protobuf modules (:mod:`tether.v1`), the run folder layout, the embedded
Redis, the tiny-model builder and the local launcher. It imports nothing heavy at package level.
"""

__version__ = "0.1.0"
