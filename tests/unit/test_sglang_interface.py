"""The SGLang adapter against the API SGLang really has (recorded from 0.5.23 in ``sglang_api.py``).

SGLang cannot be installed here (CUDA only), so a stand-in is built from the recording: it has exactly the
recorded methods of ``Engine`` and ``TokenizerManager`` — any other name is an AttributeError, any call is
bound to the recorded signature — and the ``Engine`` methods that run ``loop.run_until_complete`` fail
inside a running loop, as the real ones do. A few methods are modelled (generation, abort, pause and
continue, the weight update, the cache flush); calling an unmodelled one fails the test, which then says
what to model. Where sglang is installed, the last test checks the recording against it.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
import threading
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_server.engines.base import FINISH_ABORTED, FINISH_LENGTH, SamplingSpec
from tests.unit import sglang_api as api
from tether.config import TetherConfig


def _public(cls: type) -> dict[str, Callable[..., Any]]:
    return {k: v for k, v in vars(cls).items() if callable(v) and not k.startswith("_")}


def recorded_class(stub: type, model: type) -> type:
    """A class with exactly ``stub``'s methods: each binds its arguments to the recorded signature, then
    runs ``model``'s method of the same name with them (a dict); a method ``model`` lacks fails loudly."""
    modelled = _public(model)
    extra = set(modelled) - set(_public(stub))
    assert not extra, f"the stand-in models methods SGLang {api.RELEASE} has not: {extra}"
    namespace: dict[str, Any] = {}
    for name, fn in _public(stub).items():
        sig = inspect.signature(fn)
        is_async = inspect.iscoroutinefunction(fn)
        impl = modelled.get(name)
        if impl is not None:
            runs = inspect.iscoroutinefunction(impl) or inspect.isasyncgenfunction(impl)
            assert runs == is_async, f"{stub.__name__}.{name}: async in SGLang: {is_async}"
        namespace[name] = _method(stub.__name__, name, sig, impl, is_async)
    namespace["__getattr__"] = _no_attribute(stub.__name__)
    return type(f"Recorded{stub.__name__}", (), namespace)


def _method(owner: str, name: str, sig: inspect.Signature, impl: Any, is_async: bool) -> Callable[..., Any]:
    def bind(self: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = sig.bind(self, *args, **kwargs)  # TypeError: not how SGLang's method is called
        bound.apply_defaults()
        out = {k: v for k, v in bound.arguments.items() if k != "self"}
        out.update(out.pop("kwargs", {}) if "kwargs" in sig.parameters else {})
        if owner == "Engine" and name in api.ENGINE_RUNS_UNTIL_COMPLETE:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                raise RuntimeError(f"Engine.{name} runs loop.run_until_complete: This event loop is already running")
        if impl is None:
            raise AssertionError(f"{owner}.{name} exists in SGLang {api.RELEASE} but the stand-in does not model it")
        return out

    if is_async and inspect.isasyncgenfunction(impl):

        def agen(self: Any, *args: Any, **kwargs: Any) -> Any:
            return impl(self, bind(self, args, kwargs))

        return agen
    if is_async:

        async def coro(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await impl(self, bind(self, args, kwargs))

        return coro

    def plain(self: Any, *args: Any, **kwargs: Any) -> Any:
        return impl(self, bind(self, args, kwargs))

    return plain


def _no_attribute(owner: str) -> Callable[[Any, str], Any]:
    def __getattr__(self: Any, name: str) -> Any:
        raise AttributeError(f"SGLang {api.RELEASE}'s {owner} has no attribute {name!r}")

    return __getattr__


def _struct(name: str, fields: tuple[str, ...]) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"{name} takes keyword arguments only")
        unknown = set(kwargs) - set(fields)
        if unknown:
            raise TypeError(f"{name} has no field(s) {sorted(unknown)}")
        self.__dict__.update(kwargs)

    return type(name, (), {"__init__": __init__, "__repr__": lambda self: f"{name}({self.__dict__})"})


STRUCTS = {name: _struct(name, fields) for name, fields in api.STRUCTS.items()}


# ---- the modelled behaviour -------------------------------------------------------------------------


class TokenizerManagerModel:
    """One scheduler in miniature: tokens are made only when asked for and only while not paused; token
    ``100 + w`` comes from weights ``w`` (each update adds one), so a token says which weights made it."""

    def __init__(self) -> None:  # not SGLang's constructor: the stand-in is made here, not by the adapter
        self.context_len = 4096
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.paused, self.weights, self.live = False, 0, 0
        self.aborted: set[str] = set()
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def auto_create_handle_loop(self, a: dict) -> None:
        if self.event_loop is not None:
            return
        self.event_loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():  # as SGLang does
            self.event_loop.add_signal_handler(signal.SIGTERM, self.calls.append, ("sglang_sigterm", {}))

    async def generate_request(self, a: dict) -> Any:
        self.auto_create_handle_loop()
        obj = a["obj"]
        single = isinstance(obj.rid, str)
        rids = [obj.rid] if single else list(obj.rid)
        params = [obj.sampling_params] if single else list(obj.sampling_params)
        for p in params:
            assert set(p) <= api.SAMPLING_PARAMS, f"not SamplingParams fields: {set(p) - api.SAMPLING_PARAMS}"
        self.calls.append(("generate_request", {"rid": obj.rid, "sampling_params": obj.sampling_params}))
        while self.paused:  # SGLang admits nothing while paused
            await asyncio.sleep(0.001)
        ids: list[list[int]] = [[] for _ in rids]
        pairs: list[list[tuple[float, int, None]]] = [[] for _ in rids]
        done = [False] * len(rids)
        self.live += len(rids)
        try:
            while not all(done):
                for i, rid in enumerate(rids):
                    if done[i]:
                        continue
                    while self.paused and rid not in self.aborted:
                        await asyncio.sleep(0.001)
                    reason = None
                    if rid in self.aborted:
                        reason = {"type": "abort", "message": "aborted"}
                    else:
                        ids[i].append(100 + self.weights)
                        pairs[i].append((-0.5 - self.weights, 100 + self.weights, None))
                        if len(ids[i]) >= params[i]["max_new_tokens"]:
                            reason = {"type": "length", "length": len(ids[i])}
                    done[i] = reason is not None
                    out = {"output_ids": ids[i], "meta_info": {"id": rid, "output_token_logprobs": pairs[i],
                                                              "finish_reason": reason}}  # fmt: skip
                    if not single:
                        out["index"] = i
                    yield out
                    await asyncio.sleep(0)
        finally:
            self.live -= len(rids)

    def abort_request(self, a: dict) -> None:
        self.calls.append(("abort_request", a))
        self.aborted.add(a["rid"])

    async def pause_generation(self, a: dict) -> None:
        obj = a["obj"]
        assert isinstance(obj, STRUCTS["PauseGenerationReqInput"]) and obj.mode in api.PAUSE_MODES, obj
        self.calls.append(("pause_generation", {"mode": obj.mode}))
        self.paused = True

    async def continue_generation(self, a: dict) -> None:
        assert isinstance(a["obj"], STRUCTS["ContinueGenerationReqInput"]), a
        self.calls.append(("continue_generation", {}))
        self.paused = False

    async def update_weights_from_tensor(self, a: dict) -> tuple[bool, str]:
        obj = a["obj"]
        assert isinstance(obj, STRUCTS["UpdateWeightsFromTensorReqInput"]), obj
        # Unpaused, SGLang takes the model-update writer lock: it waits for every request in flight.
        assert self.paused or not self.live, "update while unpaused with requests in flight: it waits for them all"
        self.calls.append(("update_weights_from_tensor", {"flush_cache": obj.flush_cache}))
        self.weights += 1
        return True, "ok"

    async def flush_cache(self, a: dict) -> Any:
        self.calls.append(("flush_cache", a))
        return STRUCTS["FlushCacheReqOutput"](success=True, message="")


class EngineModel:
    def __init__(self, a: dict) -> None:
        unknown = set(a) - api.SERVER_ARGS
        if unknown:  # ServerArgs(**kwargs) refuses them
            raise TypeError(f"not ServerArgs fields of SGLang {api.RELEASE}: {unknown}")
        try:
            asyncio.get_running_loop()
            self.built_on_loop = True  # loading blocks for minutes: every other task of the server stalls
        except RuntimeError:
            self.built_on_loop = False
        self.server_args = a
        self.tokenizer_manager = FakeTokenizerManager()

    async def async_generate(self, a: dict) -> Any:
        obj = SimpleNamespace(**{k: a[k] for k in ("input_ids", "sampling_params", "rid", "stream", "return_logprob")})
        generator = self.tokenizer_manager.generate_request(obj, None)
        return generator if a["stream"] is True else await generator.__anext__()

    def shutdown(self, a: dict) -> None:
        pass


FakeTokenizerManager = recorded_class(api.TokenizerManager, TokenizerManagerModel)
FakeEngine = recorded_class(api.Engine, EngineModel)


def _init_engine(self: Any, **kwargs: Any) -> None:
    sig = inspect.signature(api.Engine.__init__)
    sig.bind(self, **kwargs)
    EngineModel.__init__(self, kwargs)


def _init_tm(self: Any) -> None:
    TokenizerManagerModel.__init__(self)


FakeEngine.__init__ = _init_engine  # type: ignore[method-assign]
FakeTokenizerManager.__init__ = _init_tm  # type: ignore[method-assign]


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The adapter, with ``sglang`` standing in as recorded."""
    io_struct = ModuleType("sglang.srt.managers.io_struct")
    for name, cls in STRUCTS.items():
        setattr(io_struct, name, cls)
    utils = ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = SimpleNamespace(serialize=lambda obj, output_str=False: obj)  # type: ignore[attr-defined]
    sglang = ModuleType("sglang")
    sglang.Engine = FakeEngine  # type: ignore[attr-defined]
    for name, module in {"sglang": sglang, "sglang.srt": ModuleType("sglang.srt"),
                         "sglang.srt.managers": ModuleType("sglang.srt.managers"),
                         "sglang.srt.managers.io_struct": io_struct, "sglang.srt.utils": utils}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    import transformers

    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace(decode=lambda ids, **k: "")
    )
    from rollout_server.engines.sglang_engine import SglangEngine

    cfg = TetherConfig.model_validate(
        {"run": {"seed": 11}, "model": {"path": "/models/m"}, "rollout": {"engine": {"type": "sglang"}}}
    )
    return SglangEngine(cfg)


async def test_start_builds_the_engine_off_the_loop_and_keeps_the_servers_sigterm(engine) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    host: list[str] = []
    loop.add_signal_handler(signal.SIGTERM, host.append, "drain")  # the rollout server's (rollout_server/main.py)
    try:
        await engine.start()
        llm = engine.llm
        assert not llm.built_on_loop, "sglang.Engine (minutes of loading) was built on the event loop"
        assert llm.server_args["random_seed"] == 11
        tm = llm.tokenizer_manager
        assert tm.event_loop is loop, "the tokenizer manager's receive loop must run on the server's loop"
        handle = loop._signal_handlers[signal.SIGTERM]  # what asyncio calls on SIGTERM
        handle._callback(*handle._args)
        assert host == ["drain"], "SGLang's SIGTERM handler replaced the server's drain"
        assert engine.max_model_len == 4096  # model.max_model_len unset: SGLang's context length
        await engine.shutdown()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def test_stream_names_each_sample_with_a_rid_and_seed_and_abort_reaches_sglang(engine) -> None:  # type: ignore[no-untyped-def]
    await engine.start()
    tm = engine.llm.tokenizer_manager
    agen = engine.stream([1, 2, 3], SamplingSpec(n=2, max_tokens=4, seed=5), request_id="req")
    first = await agen.__anext__()
    assert first.token_ids == [100] and first.logprobs == [-0.5] and first.versions == [0]
    [(_, sent)] = [c for c in tm.calls if c[0] == "generate_request"]
    assert sent["rid"] == ["req/0", "req/1"]
    seeds = [p["sampling_seed"] for p in sent["sampling_params"]]
    assert None not in seeds and len(set(seeds)) == 2, "each sample needs a seed of its own"
    assert engine.running_requests == 1
    await engine.abort("req")
    assert [c[1]["rid"] for c in tm.calls if c[0] == "abort_request"] == ["req/0", "req/1"]
    rest = [c async for c in agen]
    finishes = {c.index: c.finish_reason for c in rest if c.finish_reason}
    assert finishes == {0: FINISH_ABORTED, 1: FINISH_ABORTED}
    assert engine.running_requests == 0
    # one sample: a single request to SGLang, with the seed derived the same way
    samples = await engine.generate([1], SamplingSpec(n=1, max_tokens=3, seed=5), request_id="one")
    assert samples[0].token_ids == [100, 100, 100] and samples[0].finish_reason == FINISH_LENGTH
    last = [c[1] for c in tm.calls if c[0] == "generate_request"][-1]
    assert last["rid"] == "one/0" and last["sampling_params"]["sampling_seed"] == seeds[0]


async def test_pause_update_resume_go_through_the_tokenizer_manager_and_tag_tokens_by_version(engine) -> None:  # type: ignore[no-untyped-def]
    await engine.start()
    tm = engine.llm.tokenizer_manager
    agen = engine.stream([1], SamplingSpec(n=1, max_tokens=5), request_id="r")
    chunks = [await agen.__anext__(), await agen.__anext__()]
    await engine.pause("keep")
    assert engine.paused and tm.paused, "pause must reach SGLang's scheduler (TokenizerManager.pause_generation)"
    await engine.load_weights(iter([("w", torch.ones(2))]), version=1)
    engine.policy_version = 1  # weight sync sets it after the load
    await engine.resume()
    assert not engine.paused and not tm.paused
    chunks += [c async for c in agen]
    tokens = [t for c in chunks for t in c.token_ids]
    versions = [v for c in chunks for v in c.versions]
    assert tokens == [100, 100, 101, 101, 101]  # two tokens on the old weights, three on the new
    assert versions == [t - 100 for t in tokens], "each token carries the version of the weights that made it"
    names = [c[0] for c in tm.calls]
    assert (
        names.index("pause_generation") < names.index("update_weights_from_tensor") < names.index("continue_generation")
    )
    assert [c[1]["mode"] for c in tm.calls if c[0] == "pause_generation"] == ["retract"]


async def test_drain_waits_for_requests_in_flight_before_the_update(engine) -> None:  # type: ignore[no-untyped-def]
    await engine.start()
    tm = engine.llm.tokenizer_manager
    agen = engine.stream([1], SamplingSpec(n=2, max_tokens=3), request_id="d")
    chunks = [await agen.__anext__()]
    draining = asyncio.create_task(engine.pause("drain"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not draining.done(), "drain returned with a request in flight"
    assert not tm.paused  # the samples in flight run to their end
    chunks += [c async for c in agen]  # the stream is read to its end: only then is the request done
    await draining
    assert tm.paused and sum(len(c.token_ids) for c in chunks) == 6
    await engine.load_weights(iter([("w", torch.ones(2))]), version=1)
    await engine.resume()


def test_the_stand_in_refuses_what_sglang_lacks() -> None:
    """The checks above can fail: the adapter's old calls are refused here as by SGLang."""
    llm = FakeEngine(model_path="m")
    assert getattr(llm, "pause_generation", None) is None  # no such Engine method: pause did nothing
    with pytest.raises(TypeError):
        FakeEngine(model_path="m", gpu_memory_utilization=0.5)  # vLLM's name, not a ServerArgs field

    async def inside_a_loop() -> None:
        with pytest.raises(RuntimeError, match="already running"):
            llm.flush_cache()

    asyncio.run(inside_a_loop())


def test_the_recording_matches_the_installed_sglang() -> None:
    engine_mod = pytest.importorskip("sglang.srt.entrypoints.engine", reason="sglang is not installed (GPU only)")
    tm_mod = pytest.importorskip("sglang.srt.managers.tokenizer_manager")
    for real, stub in ((engine_mod.Engine, api.Engine), (tm_mod.TokenizerManager, api.TokenizerManager)):
        for name, fn in _public(stub).items():
            got = getattr(real, name)
            assert list(inspect.signature(got).parameters) == list(inspect.signature(fn).parameters), name
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(fn), name


def test_sglang_logprobs_are_declared_as_what_its_sampler_returns() -> None:
    """SGLang returns log-probs after temperature unless SGLANG_RETURN_ORIGINAL_LOGPROB is true (issue 44, item 6):
    the learner must score them at the sample's temperature (``processed``), not at T = 1 (``raw``)."""
    from learner.batch import sample_temperature
    from rollout_server.engines.sglang_engine import sglang_logprob_source
    from tether.trajectory import TEMPERATURE_KEY, TrajectoryData

    assert sglang_logprob_source({}) == "processed"
    assert sglang_logprob_source({"SGLANG_RETURN_ORIGINAL_LOGPROB": "False"}) == "processed"
    for flag in ("1", "true", "TRUE"):
        assert sglang_logprob_source({"SGLANG_RETURN_ORIGINAL_LOGPROB": flag}) == "raw"
    one = {"prompt_token_ids": [1], "completion_token_ids": [2], "behavior_logprobs": [-1.0], "policy_versions": [0]}
    t = TrajectoryData(
        **one, loss_mask=[1], metadata={TEMPERATURE_KEY: "0.7"}, logprob_source=sglang_logprob_source({})
    )
    assert sample_temperature(t, 1.0) == pytest.approx(0.7)
