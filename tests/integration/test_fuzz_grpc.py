"""Fuzzing every Rollout and Control method of a real rollout server process with hypothesis.

Requests are built from the proto descriptors (so a field added to a proto is fuzzed without touching
this file): random sizes, negative and huge numbers, NaN/inf floats, unknown enum values, unicode with
NULs, missing fields, half-set oneofs; and random bytes sent as the raw request body, so the server
must parse garbage itself. The contract: only the documented status codes come back — never UNKNOWN
or INTERNAL, which would mean an unhandled exception — and afterwards the server still reports
SERVING and answers a normal Generate. One server for the module; generation is capped at a few
tokens so the whole file takes about a minute on two cores.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_server.launch import ServerProcess, spawn_server
from tether.client import RolloutClient
from tether.redis_server import free_port
from tether.v1 import control_pb2, rollout_pb2

pytestmark = pytest.mark.slow

MAX_MESSAGE = 64 * 1024
# Codes the protos document; OUT_OF_RANGE is an episode that filled the model's context.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
}
FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- requests from descriptors -----------------------------------------------------------------------

F = FieldDescriptor
_TEXT = st.one_of(
    st.sampled_from(["", "\x00", "user", "assistant", "hi", "a\x00b", "\u202e\ufeff", "🙂" * 3, "nccl", "gloo"]),
    st.text(max_size=40),  # hypothesis' default alphabet has no surrogates but does have NULs
    st.text(max_size=2000),
    st.just("x" * 100_000),  # over the message limit on its own: RESOURCE_EXHAUSTED
)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    # Mostly small values (valid n, token ids, ranks), then anything the type holds.
    return st.one_of(
        st.integers(max(lo, -2), min(hi, 8)), st.sampled_from([lo, hi, -1 if lo < 0 else 0]), st.integers(lo, hi)
    )


_SCALARS: dict[int, st.SearchStrategy] = {
    F.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: _ints(0, 2**32 - 1),
    F.TYPE_FIXED32: _ints(0, 2**32 - 1),
    F.TYPE_UINT64: _ints(0, 2**64 - 1),
    F.TYPE_FIXED64: _ints(0, 2**64 - 1),
    F.TYPE_FLOAT: st.one_of(st.sampled_from([0.0, 1.0, 0.5, -1.0]), st.floats(width=32)),  # NaN, ±inf included
    F.TYPE_DOUBLE: st.one_of(st.sampled_from([0.0, 1.0, -1e308]), st.floats()),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: _TEXT,
    F.TYPE_BYTES: st.binary(max_size=64),
}


def _value(field: FieldDescriptor, depth: int, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    if field.name in overrides:
        return overrides[field.name]
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, depth=depth + 1, overrides=overrides)
    if field.type == F.TYPE_ENUM:
        # proto3 enums are open: a newer client may send a value this server has never heard of.
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 1000))
    return _SCALARS[field.type]


@st.composite
def messages(draw: st.DrawFn, desc: Descriptor, *, depth: int = 0, overrides: dict | None = None):
    """A random instance of the message ``desc``: any subset of fields, at most one per oneof."""
    overrides = overrides or {}
    msg = message_factory.GetMessageClass(desc)()
    chosen = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in desc.oneofs}
    for field in desc.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] != field.name:
            continue
        if oneof is None and not draw(st.booleans()):
            continue  # a missing field
        if depth > 3 and field.type == F.TYPE_MESSAGE:
            continue
        target = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for k, v in draw(st.dictionaries(_value(key_f, depth, {}), _value(val_f, depth, {}), max_size=4)).items():
                target[k] = v
        elif field.is_repeated:
            values = draw(st.lists(_value(field, depth, overrides), max_size=6))
            if field.type == F.TYPE_MESSAGE:
                for v in values:
                    target.add().CopyFrom(v)
            else:
                target.extend(values)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(draw(_value(field, depth, overrides)))
        else:
            setattr(msg, field.name, draw(_value(field, depth, overrides)))
    return msg


# -- the server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, redis_server: str, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("fuzz")
    proc = spawn_server(
        [
            "--model.path",
            str(tiny_model_dir),
            "--model.max_model_len",
            "256",
            "--run.run_id",
            f"fuzz-{uuid.uuid4().hex[:8]}",  # with Redis, so episodes can really be written
            "--run.output_dir",
            str(tmp / "runs"),
            "--buffer.redis_url",
            redis_server,
            "--rollout.prompt_workers",
            "0",
            "--rollout.max_tokens",
            "4",
            "--rollout.max_prompt_len",
            "128",
            "--rollout.max_n",
            "4",
            "--rollout.max_message_bytes",
            str(MAX_MESSAGE),
        ],
        port=free_port(),
        log_path=tmp / "server.log",
    )
    yield proc
    assert proc.terminate() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def channel(server: ServerProcess):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


# Paths and message types of every method; the raw-bytes fuzz and the typed fuzz share this table.
ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]
CONTROL = control_pb2.DESCRIPTOR.services_by_name["Control"]
METHODS = {f"/{svc.full_name}/{m.name}": m for svc in (ROLLOUT, CONTROL) for m in svc.methods}


def call(channel: grpc.Channel, path: str, request: bytes, *, timeout_s: float = 60) -> grpc.StatusCode:
    """Send ``request`` as the raw body (no client-side serialization); the status code that comes back."""
    method = METHODS[path]
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(request, timeout=timeout_s):
                pass
        else:
            channel.unary_unary(path)(request, timeout=timeout_s)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{path}: {e.code().name}: {e.details()}"
        return e.code()
    return grpc.StatusCode.OK


def assert_healthy(server: ServerProcess, channel: grpc.Channel) -> None:
    assert server.proc.poll() is None, server.log_tail()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with RolloutClient(server.address, timeout_s=60) as c:
        assert c.generate(text="after the fuzz", n=1, max_tokens=2).samples[0].token_ids
        assert not c.status().paused


def _episode_ids(channel: grpc.Channel, count: int) -> list[str]:
    """Real open episodes, so Step and CloseEpisode are fuzzed past the NOT_FOUND check too."""
    stub = channel.unary_unary(
        "/tether.v1.Rollout/OpenEpisode",
        request_serializer=rollout_pb2.OpenEpisodeRequest.SerializeToString,
        response_deserializer=rollout_pb2.OpenEpisodeResponse.FromString,
    )
    return [stub(rollout_pb2.OpenEpisodeRequest(text=f"episode {i}:"), timeout=30).episode_id for i in range(count)]


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [m.name for m in ROLLOUT.methods if m.name not in ("Step", "CloseEpisode")])
def test_fuzz_rollout_method(server: ServerProcess, channel: grpc.Channel, name: str) -> None:
    path = f"/{ROLLOUT.full_name}/{name}"

    @FUZZ
    @given(messages(METHODS[path].input_type))
    def fuzz(request) -> None:
        call(channel, path, request.SerializeToString())

    fuzz()
    assert_healthy(server, channel)


@pytest.mark.parametrize("name", ["Step", "CloseEpisode"])
def test_fuzz_episode_calls_on_live_episodes(server: ServerProcess, channel: grpc.Channel, name: str) -> None:
    path = f"/{ROLLOUT.full_name}/{name}"
    ids = _episode_ids(channel, 8)
    # Half the time a live episode, so the fuzz reaches the engine and the buffer write.
    episode_id = st.one_of(st.sampled_from(ids), _TEXT)

    @FUZZ
    @given(messages(METHODS[path].input_type, overrides={"episode_id": episode_id}))
    def fuzz(request) -> None:
        call(channel, path, request.SerializeToString())

    fuzz()
    assert_healthy(server, channel)


@pytest.mark.parametrize("name", [m.name for m in CONTROL.methods])
def test_fuzz_control_method(server: ServerProcess, channel: grpc.Channel, name: str) -> None:
    path = f"/{CONTROL.full_name}/{name}"
    abort = f"/{CONTROL.full_name}/AbortWeightUpdate"
    # Prepare's update ids are drawn from a few, so Commit and Abort sometimes name a prepared update.
    update_id = st.sampled_from(["", "u1", "u2", "\x00"])

    @FUZZ
    @given(messages(METHODS[path].input_type, overrides={"update_id": update_id}), st.booleans())
    def fuzz(request, commit_it: bool) -> None:
        code = call(channel, path, request.SerializeToString())
        if name == "PrepareWeightUpdate" and code == grpc.StatusCode.OK and commit_it:
            # Commit what was just prepared: its source is junk, so the transfer fails cleanly.
            commit = control_pb2.CommitWeightUpdateRequest(update_id=request.update_id, version=request.version)
            call(channel, f"/{CONTROL.full_name}/CommitWeightUpdate", commit.SerializeToString())
        # Leave the server as found: a Pause or a Prepare stops generation until Resume / Abort.
        call(channel, abort, b"")
        call(channel, f"/{CONTROL.full_name}/Resume", b"")

    fuzz()
    assert_healthy(server, channel)


def test_version_past_int32_is_refused(server: ServerProcess, channel: grpc.Channel) -> None:
    """Found by this fuzz: a plan of version 2**63-1 with no tensors committed, and from then on every
    CloseEpisode failed INTERNAL (each token's version is stored as int32)."""
    for version in (2**31, 2**63 - 1):
        plan = control_pb2.WeightUpdatePlan(version=version, update_id="big", filesystem={"path": "/nonexistent"})
        assert call(channel, f"/{CONTROL.full_name}/PrepareWeightUpdate", plan.SerializeToString()) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    with RolloutClient(server.address, timeout_s=60) as c:
        assert c.status().policy_version < 2**31
        ep = c.open_episode(text="count:")
        c.step(ep.episode_id)
        assert c.close_episode(ep.episode_id, reward=1.0).group_written


@FUZZ
@given(
    path=st.sampled_from(sorted(METHODS)), body=st.one_of(st.binary(max_size=512), st.binary(min_size=1, max_size=8))
)
def test_fuzz_raw_bytes_to_every_method(server: ServerProcess, channel: grpc.Channel, path: str, body: bytes) -> None:
    call(channel, path, body)
    if path.endswith(("/Pause", "/PrepareWeightUpdate")):  # garbage can parse as a valid Pause
        call(channel, f"/{CONTROL.full_name}/AbortWeightUpdate", b"")
        call(channel, f"/{CONTROL.full_name}/Resume", b"")


def test_server_healthy_after_raw_bytes(server: ServerProcess, channel: grpc.Channel) -> None:
    assert_healthy(server, channel)


def test_wrong_message_type_is_refused_or_ignored(server: ServerProcess, channel: grpc.Channel) -> None:
    """A valid protobuf of another type parses (unknown fields) but must still get a defined answer."""
    body = control_pb2.WeightUpdatePlan(version=7, update_id="x", filesystem={"path": "/"}).SerializeToString()
    codes = {path: call(channel, path, body) for path in METHODS if not path.endswith("/Pause")}
    assert codes["/tether.v1.Rollout/Generate"] == grpc.StatusCode.INVALID_ARGUMENT
    call(channel, f"/{CONTROL.full_name}/AbortWeightUpdate", b"")
    assert_healthy(server, channel)


@FUZZ
@given(timeout_s=st.floats(0.001, 0.05), text=st.text(min_size=1, max_size=20))
def test_short_deadlines(server: ServerProcess, channel: grpc.Channel, timeout_s: float, text: str) -> None:
    """The caller's own short deadline may expire: DEADLINE_EXCEEDED then, and only then."""
    request = rollout_pb2.GenerateRequest(text=text, sampling=rollout_pb2.SamplingParams(n=4))
    try:
        channel.unary_unary("/tether.v1.Rollout/Generate")(request.SerializeToString(), timeout=timeout_s)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED}, f"{e.code().name}: {e.details()}"


def test_server_healthy_after_short_deadlines(server: ServerProcess, channel: grpc.Channel) -> None:
    assert_healthy(server, channel)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_is_refused_and_the_episode_survives(server: ServerProcess, reward: float) -> None:
    """Found by this fuzz: a NaN reward was written to the buffer, where it poisons the group's advantages."""
    with RolloutClient(server.address, timeout_s=60) as c:
        ep = c.open_episode(text="count:")
        c.step(ep.episode_id)
        for kw in ({"reward": reward}, {"reward": 1.0, "components": {"format": reward}}):
            with pytest.raises(grpc.RpcError) as err:
                c.close_episode(ep.episode_id, **kw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "finite" in err.value.details()
        assert c.close_episode(ep.episode_id, reward=1.0).group_written
