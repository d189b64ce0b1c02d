"""The Python API of SGLang 0.5.23 (the release on PyPI in 2026-10) that tether's adapter may touch, recorded.

SGLang needs a CUDA GPU and its own CUDA wheels, so it cannot be installed where tether's unit tests run;
``test_sglang_interface.py`` drives ``rollout_server/engines/sglang_engine.py`` through a stand-in built
from these stubs. Recorded from the sglang-0.5.23 wheel's sources, by hand-run ``ast`` over:

- ``sglang/srt/entrypoints/engine.py``: ``class Engine`` — every public method of the class body
  (``EngineScoreMixin``'s scoring methods left out), and which of them run ``loop.run_until_complete``;
- ``sglang/srt/managers/tokenizer_manager.py`` (``class TokenizerManager``) and
  ``sglang/srt/managers/tokenizer_control_mixin.py`` (``class TokenizerControlMixin``, its base): every
  public method (``TokenizerManagerScoreMixin`` left out);
- ``sglang/srt/managers/io_struct.py``: the fields of the request/response structs the adapter builds or reads;
- ``sglang/srt/arg_groups/fields/*.py``: the ``ServerArgs`` fields the adapter passes to ``Engine(**kwargs)``
  (a subset: name a new one here only after finding it in the release);
- ``sglang/srt/sampling/sampling_params.py``: ``SamplingParams``' fields (the keys of ``sampling_params``).

Defaults are recorded as ``None`` (only the names, order and kinds of parameters matter here). Updating to a
newer SGLang means re-recording this file from that release and rerunning the test.
"""

from __future__ import annotations

RELEASE = "0.5.23"

SERVER_ARGS = frozenset(
    {
        "model_path",  # fields/model.py
        "trust_remote_code",
        "context_length",
        "dtype",
        "mem_fraction_static",  # fields/schedule.py
        "max_running_requests",
        "tp_size",  # fields/parallel.py
        "random_seed",  # fields/device.py
        "incremental_streaming_output",  # fields/serving.py
        "skip_tokenizer_init",
        "log_level",  # fields/observability.py
        "enable_deterministic_inference",  # fields/exec_.py
    }
)
"""``ServerArgs`` fields (``Engine(**kwargs)``), the subset checked to exist in the release."""

SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
        "custom_params", "watermark",
    }
)  # fmt: skip
"""``SamplingParams``' public fields: the keys a ``sampling_params`` dict may have."""

STRUCTS = {
    # io_struct.py; every BaseReq also has rid and http_worker_ipc
    "PauseGenerationReqInput": ("mode", "rid", "http_worker_ipc"),
    "ContinueGenerationReqInput": ("torch_empty_cache", "rid", "http_worker_ipc"),
    "UpdateWeightsFromTensorReqInput": (
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "selector", "torch_empty_cache", "rid", "http_worker_ipc",
    ),
    "FlushCacheReqOutput": ("success", "message", "rid", "http_worker_ipc"),
}  # fmt: skip
"""Request/response structs (msgspec, keyword-only) and their fields."""

PAUSE_MODES = ("abort", "retract", "in_place")
"""``PauseGenerationReqInput.mode``."""


ENGINE_RUNS_UNTIL_COMPLETE = frozenset(
    {
        "generate",
        "encode",
        "rerank",
        "flush_cache",
        "open_session",
        "close_session",
        "start_profile",
        "stop_profile",
        "start_expert_distribution_record",
        "stop_expert_distribution_record",
        "dump_expert_distribution_record",
        "get_server_info",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_disk",
        "update_weights_from_ipc",
        "get_weights_by_name",
        "load_lora_adapter_from_tensors",
        "load_lora_adapter",
        "unload_lora_adapter",
        "release_memory_occupation",
        "resume_memory_occupation",
        "freeze_gc",
    }
)
"""Engine methods whose body is ``self.loop.run_until_complete(...)``: they fail inside a running loop."""


class Engine:
    tokenizer_manager: TokenizerManager

    def __init__(self, **kwargs): ...

    def get_all_child_pids(self): ...

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        mm_hashes=None,
        mm_content_hashes=None,
        return_logprob=None,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        require_reasoning=None,
        return_hidden_states=None,
        return_routed_experts=None,
        routed_experts_start_len=None,
        stream=None,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        kv_hints=None,
        data_parallel_rank=None,
        external_trace_header=None,
        rid=None,
        session_params=None,
        priority=None,
        session_id=None,
        *,
        cache_salt=None,
    ): ...

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        mm_hashes=None,
        mm_content_hashes=None,
        return_logprob=None,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        require_reasoning=None,
        return_hidden_states=None,
        return_routed_experts=None,
        routed_experts_start_len=None,
        stream=None,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        kv_hints=None,
        data_parallel_rank=None,
        external_trace_header=None,
        rid=None,
        session_params=None,
        priority=None,
        session_id=None,
        *,
        cache_salt=None,
    ): ...

    def encode(
        self,
        prompt,
        image_data=None,
        audio_data=None,
        video_data=None,
        dimensions=None,
        lora_path=None,
        embed_override_token_id=None,
        embed_overrides=None,
        external_trace_header=None,
        rid=None,
    ): ...

    async def async_encode(
        self,
        prompt,
        image_data=None,
        audio_data=None,
        video_data=None,
        dimensions=None,
        lora_path=None,
        embed_override_token_id=None,
        embed_overrides=None,
        external_trace_header=None,
        rid=None,
    ): ...

    def rerank(self, prompt): ...

    def shutdown(self): ...

    def flush_cache(self): ...

    def open_session(self, capacity_of_str_len, session_id=None, streaming=None, timeout=None): ...

    def close_session(self, session_id): ...

    def start_profile(self, **kwargs): ...

    def stop_profile(self): ...

    def start_expert_distribution_record(self): ...

    def stop_expert_distribution_record(self): ...

    def dump_expert_distribution_record(self): ...

    def get_server_info(self): ...

    def get_model_info(self): ...

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend=None
    ): ...

    def destroy_weights_update_group(self, group_name): ...

    def begin_weight_update(self, selector=None): ...

    def end_weight_update(self): ...

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name=None, flush_cache=None, load_format=None
    ): ...

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=None): ...

    def update_weights_from_disk(self, model_path, load_format=None): ...

    def update_weights_from_ipc(self, zmq_handles, flush_cache=None): ...

    def get_weights_by_name(self, name, truncate_size=None): ...

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None): ...

    def load_lora_adapter(self, lora_name, lora_path, pinned=None): ...

    def unload_lora_adapter(self, lora_name): ...

    async def async_load_lora_adapter(self, lora_name, lora_path, pinned=None): ...

    async def async_unload_lora_adapter(self, lora_name): ...

    def release_memory_occupation(self, tags=None): ...

    def resume_memory_occupation(self, tags=None): ...

    def freeze_gc(self): ...

    def collective_rpc(self, method, **kwargs): ...

    def save_remote_model(self, **kwargs): ...

    def save_sharded_model(self, **kwargs): ...


class TokenizerManager:
    context_len: int

    def abort_request(self, rid=None, abort_all=None): ...

    async def add_external_corpus(self, obj): ...

    def add_logprob_to_meta_info(
        self, meta_info, state, top_logprobs_num, token_ids_logprob, return_text_in_logprobs, finished
    ): ...

    async def attach_hicache_storage(
        self,
        hicache_storage_backend,
        hicache_storage_backend_extra_config_json=None,
        hicache_storage_prefetch_policy=None,
        hicache_write_policy=None,
    ): ...

    def auto_create_handle_loop(self): ...

    async def begin_weight_update(self, obj, request=None): ...

    async def check_weights(self, obj, request=None): ...

    async def clear_hicache_storage(self): ...

    async def close_session(self, obj, request=None): ...

    def collect_metrics(self, state, recv_obj, i): ...

    def config_value(self, name): ...

    def configure_logging(self, obj): ...

    async def continue_generation(self, obj): ...

    def convert_logprob_style(
        self,
        meta_info,
        state,
        top_logprobs_num,
        token_ids_logprob,
        return_text_in_logprobs,
        recv_obj,
        recv_obj_index,
        finished,
    ): ...

    def convert_to_span_attrs(self, state, recv_obj, i): ...

    def create_abort_task(self, obj): ...

    async def destroy_weights_update_group(self, obj, request=None): ...

    async def detach_hicache_storage(self): ...

    def detokenize_logprob_tokens(self, token_logprobs_val, token_logprobs_idx, decode_to_text): ...

    def detokenize_top_logprobs_tokens(self, token_logprobs_val, token_logprobs_idx, decode_to_text): ...

    async def dump_expert_distribution_record(self): ...

    def dump_requests(self, state, out_dict): ...

    def dump_requests_before_crash(self, hostname=None): ...

    async def dumper_control(self, obj): ...

    async def end_weight_update(self, obj, request=None): ...

    async def flush_cache(self, timeout_s=None): ...

    def force_exit_handler(self): ...

    def forward_elastic_scale_update(self, msg): ...

    async def freeze_gc(self): ...

    async def generate_request(self, obj, request=None): ...

    def get_elastic_ep_state(self): ...

    async def get_hicache_l3_cache_layout(self): ...

    async def get_internal_state(self): ...

    async def get_loads(self, include=None, dp_rank=None): ...

    async def get_weights_by_name(self, obj, request=None): ...

    async def handle_loop(self): ...

    def init_communicators(self): ...

    def init_disaggregation(self, *, start_pd_bootstrap_service=None): ...

    def init_ipc_channels(self, port_args): ...

    def init_lora(self): ...

    def init_metric_collector_watchdog(self): ...

    def init_model_config(self): ...

    def init_positional_embeds_transport(self): ...

    def init_request_dispatcher(self): ...

    def init_request_logging_and_dumping(self): ...

    def init_running_status(self): ...

    def init_tokenizer_and_processor(self): ...

    def init_weight_update(self): ...

    async def init_weights_send_group_for_remote_instance(self, obj, request=None): ...

    async def init_weights_update_group(self, obj, request=None): ...

    def is_healthy(self): ...

    def is_ready(self): ...

    async def list_external_corpora(self): ...

    async def load_lora_adapter(self, obj, _=None): ...

    async def load_lora_adapter_from_tensors(self, obj, _=None): ...

    async def open_session(self, obj, request=None): ...

    async def pause_generation(self, obj): ...

    async def pd_role_switch(self, obj, request=None): ...

    def record_config_updates(self, source, **fields): ...

    def record_request_for_crash_dump(self, state, out_dict): ...

    async def release_memory_occupation(self, obj, request=None): ...

    async def remove_external_corpus(self, corpus_id): ...

    def resolved_config_dict(self, base): ...

    async def resume_memory_occupation(self, obj, request=None): ...

    async def scale_elastic_ep(self, obj): ...

    async def send_weights_to_remote_instance(self, obj, request=None): ...

    def set_engine_state_changed_callback(self, callback): ...

    async def set_internal_state(self, obj): ...

    def set_server_stop_hook(self, hook): ...

    def set_startup_time(self, startup_time): ...

    async def sigterm_watchdog(self): ...

    async def slow_down(self, obj, request=None): ...

    async def start_expert_distribution_record(self): ...

    async def start_profile(self, req=None): ...

    async def stop_expert_distribution_record(self): ...

    async def stop_profile(self): ...

    async def unload_lora_adapter(self, obj, _=None): ...

    def update_active_ranks(self, ranks): ...

    def update_control_communicator_fan_out(self, worker_count): ...

    def update_request_meta_info(self, meta_info, state, customized_info, index, finish_reason): ...

    async def update_weight_version(self, obj): ...

    async def update_weights_from_disk(self, obj, request=None): ...

    async def update_weights_from_distributed(self, obj, request=None): ...

    async def update_weights_from_ipc(self, obj, request=None): ...

    async def update_weights_from_tensor(self, obj, request=None): ...
