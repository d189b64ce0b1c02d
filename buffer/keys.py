"""Every Redis key of a run, in one place, so no module spells a key by hand.

All keys live under ``tether:{run_id}:`` so several runs can share one Redis and ``tether status``
can find a run by its id alone. Consumer-group names are constants here for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_GROUP = "rollout"
"""Consumer group of the rollout servers on the prompts stream."""

LEARNER_GROUP = "learner"
"""Consumer group of the learner on the trajectories stream."""

VALIDATION_GROUP = "rollout-val"
"""Consumer group of the rollout servers on the validation prompts stream."""

RUNS = "tether:runs"
"""Set of the run ids whose learners published their config: what a fleet serving every run that asks
(``tether rollout --runs '*'``) joins. The one key outside any run's prefix."""


@dataclass(frozen=True)
class RedisKeys:
    run_id: str

    @property
    def prefix(self) -> str:
        return f"tether:{self.run_id}:"

    @property
    def prompts(self) -> str:
        """Stream of ``Prompt`` protobufs, fed by learner rank 0."""
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        """Stream of ``TrajectoryGroup`` entries; an entry is deleted once acknowledged."""
        return self.prefix + "trajectories"

    @property
    def dead_letter(self) -> str:
        """Stream of entries that could not be used, each with the reason (capped in length)."""
        return self.prefix + "dead_letter"

    @property
    def version(self) -> str:
        """The published policy version (an integer string)."""
        return self.prefix + "version"

    @property
    def counters(self) -> str:
        """Hash of monotonic counters (produced, acknowledged, ...) and the live byte total."""
        return self.prefix + "counters"

    @property
    def lifetimes(self) -> str:
        """List of JSON entries, one per learner start: step, version and the counters at that moment."""
        return self.prefix + "lifetimes"

    @property
    def staleness(self) -> str:
        """Hash lag -> number of groups trained on with that staleness."""
        return self.prefix + "staleness"

    @property
    def lengths(self) -> str:
        """Hash ``<counter>:<bucket>`` -> completions settled in that counter with that length bucket, and
        ``<counter>:tokens`` -> their tokens (:mod:`buffer.lengths`)."""
        return self.prefix + "lengths"

    @property
    def servers(self) -> str:
        """Set of rollout-server ids that have heartbeated (an index; liveness is the per-server key)."""
        return self.prefix + "servers"

    def server(self, server_id: str) -> str:
        """One rollout server's heartbeat: JSON ``ServerInfo`` with a TTL, gone when the server is."""
        return self.prefix + "server:" + server_id

    def payload(self, nonce: str) -> str:
        """The encoded group of one trajectories entry (whose ``k`` field is ``nonce``): kept out of the
        stream so the insert script never carries it (see :mod:`buffer.scripts`); deleted when settled."""
        return self.prefix + "payload:" + nonce

    def seen(self, group_id: str) -> str:
        """Idempotency marker of a group id (SET NX with a TTL), so a retried insert is a no-op."""
        return self.prefix + "seen:" + group_id

    @property
    def val_prompts(self) -> str:
        """Stream of evaluation prompts (held-out, at a given policy version): apart from ``prompts`` so
        evaluation is never under admission control nor in the training books (``buffer.evaluation``)."""
        return self.prefix + "val_prompts"

    @property
    def val_results(self) -> str:
        """Stream of scored evaluation samples, one entry per prompt; read and deleted by learner rank 0."""
        return self.prefix + "val_results"

    @property
    def run_end(self) -> str:
        """Set by the learner when the run has finished (JSON: step, version); rollout servers idle or exit."""
        return self.prefix + "run_end"

    @property
    def run_config(self) -> str:
        """The run's config as JSON (secrets and host-bound settings left out), published by the learner at
        start: a rollout fleet serving several runs (``tether rollout --runs``) serves each with its own."""
        return self.prefix + "run_config"

    @property
    def learner(self) -> str:
        """Hash the learner publishes for dashboards: ``step``, ``reward_mean``, ``tokens_per_s``, ..."""
        return self.prefix + "learner"

    @property
    def weights(self) -> str:
        """The newest version in the weight store (``store`` transport), JSON: version, the origin's
        address, dtype; written by the learner once the version's manifest is in place."""
        return self.prefix + "weights"

    @property
    def weights_held(self) -> str:
        """Hash server id -> JSON ``{"version", "peer"}``: the version each server serves and where its
        chunk service answers peers (``store`` transport); written by the server on each swap."""
        return self.prefix + "weights_held"
