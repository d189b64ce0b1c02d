"""tether: asynchronous actor-learner RL post-training for language models.

This package is the core every process shares — config models (:mod:`tether.config`), contracts (the
trajectory type, the generated protobuf modules in :mod:`tether.v1`, the run folder and its records),
logging, metrics, spans, the embedded Redis — and, as the top layer above the buffer, the learner, the
rollout server and weight sync, the command line (:mod:`tether.commands`: the CLI, ``tether up`` and its
supervisor, the viewer, the planner, the tiny-model maker), which nothing below imports. It imports nothing
heavy at package level.
"""

import os

__version__ = "0.1.0"

# Every tether process holds gRPC channels while it starts children (tether up's supervisor, the learner's weight
# sender, benches and tests launching servers), and children started with preexec_fn / start_new_session are
# fork()ed: gRPC's fork handlers then restart its epoll poller in the child between fork and exec, and the child
# can abort there with "epoll_wait error: Bad file descriptor" (grpc/grpc#43055, grpcio >= 1.80; seen here as a
# rollout server that "exited -6" before running a line). No tether process uses gRPC in a forked child
# without exec, so fork support is off, for this process and — through the environment — its children.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
