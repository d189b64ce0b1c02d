"""The Redis buffer between rollout servers and the learner (see docs/ARCHITECTURE.md, ``buffer/``).

Streams under ``tether:{run_id}:``: ``prompts`` (learner rank 0 → rollout servers, admission-controlled),
``trajectories`` (one columnar entry per GRPO group, :mod:`buffer.columnar`; idempotent and bounded,
acknowledged after the optimizer step that used it) and ``dead_letter``; plus the published version, the
server registry and counters. No pickle: groups are columnar, prompts protobuf, registry entries JSON.
"""

from buffer.codec import decode_payload, encode_payload
from buffer.dead_letter import dead_letter
from buffer.keys import LEARNER_GROUP, PROMPT_GROUP, RedisKeys
from buffer.policy import admission_allowance, staleness_of
from buffer.prompts import PromptQueue
from buffer.reader import BufferedGroup, TrajectoryReader
from buffer.registry import ServerInfo, ServerRegistry, publish_version, read_version
from buffer.stats import buffer_stats
from buffer.writer import BufferFull, TrajectoryWriter

__all__ = [
    "LEARNER_GROUP",
    "PROMPT_GROUP",
    "BufferFull",
    "BufferedGroup",
    "PromptQueue",
    "RedisKeys",
    "ServerInfo",
    "ServerRegistry",
    "TrajectoryReader",
    "TrajectoryWriter",
    "admission_allowance",
    "buffer_stats",
    "dead_letter",
    "decode_payload",
    "encode_payload",
    "publish_version",
    "read_version",
    "staleness_of",
]
