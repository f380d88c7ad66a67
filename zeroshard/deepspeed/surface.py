"""The parts of DeepSpeed 0.19.8's DeepSpeedEngine that the facade refuses, each with its reason.

`refusal(name)` is the one-line error for a DeepSpeedEngine attribute the facade does not
provide (an UnsupportedFeatureError: a ZeroshardError and a NotImplementedError). It is an AttributeError too, so
`hasattr(engine, name)` (feature detection, as Accelerate and the HF Trainer do) answers False
instead of raising. The audit table in
docs/DEEPSPEED.md lists what is supported, what differs and what is refused.
"""

from __future__ import annotations

from zeroshard.errors import UnsupportedFeatureError


class _RefusedAttribute(UnsupportedFeatureError, AttributeError):
    """A DeepSpeedEngine attribute the facade does not provide: hasattr() answers False."""


_REASONS = {
    "features zeroshard does not have (compilers, profilers, autotuning, data efficiency, MoE, sparse "
    "and 1-bit communication, state offload/reload)": (
        "compile", "get_compile_time", "register_compile_pass", "get_autosp_backend", "get_autotp_backend",
        "get_deepcompile_backend", "get_deepspeed_compile_backend", "print_forward_breakdown",
        "flops_profiler_recompute_fwd_factor", "flops_profiler_profile_step", "flops_profiler_module_depth",
        "flops_profiler_top_modules", "flops_profiler_detailed", "flops_profiler_output_file",
        "autotuning_start_profile_step", "autotuning_end_profile_step", "autotuning_metric_path",
        "autotuning_model_info_path", "autotuning_metric", "autotuning_profile_model_info",
        "data_efficiency_config", "data_sampling_config", "curriculum_learning_config", "random_ltd_config",
        "random_ltd_initialize", "set_data_post_process_func", "set_custom_curriculum_learning_schedule",
        "load_moe_state_dict", "sparse_allreduce_no_retain", "sparse_allreduce_bucket", "sparse_allreduce",
        "sparse_all_gather", "offload_states", "reload_states", "get_wall_clock_timers", "dump_state",
        "collect_python_gc", "zenflow_config", "swap_tensor_config", "aio_config", "tensor_parallel_config",
        "autotp_size", "get_sequence_parallel_group", "super_offload", "cpuadam_cores_perc",
    ),
    "the engine reduces gradients itself during backward(): there is no separate reduction to call": (
        "allreduce_gradients", "allreduce_bucket", "allreduce_and_copy", "allreduce_no_retain",
        "buffered_allreduce_fallback", "all_gather_scalar", "no_sync", "coalesce_grad_reduction",
        "clip_fp32_gradients", "scale",
    ),
    "batch sizes are fixed at initialize() (the engine's accumulation counter depends on them)": (
        "set_train_batch_size", "set_train_micro_batch_size",
    ),
    "DeepSpeed's own checkpoint loading: load_checkpoint loads zeroshard checkpoints, "
    "`zeroshard import deepspeed` converts DeepSpeed's (universal ones too), load_state_dict takes a full "
    "state dict": (
        "load_module_state_dict", "load_universal_checkpoint",
    ),
    "DeepSpeed's data loader builder: pass training_data= to initialize() instead": ("deepspeed_io",),
}

# Every public method and property of DeepSpeed 0.19.8's DeepSpeedEngine (deepspeed/runtime/engine.py);
# the facade defines most, the rest are refused rather than looked up on the model.
DEEPSPEED_ENGINE_NAMES = frozenset({
    '_zero3_consolidated_16bit_state_dict', 'aio_config', 'all_gather_scalar', 'allreduce_and_copy',
    'allreduce_bucket', 'allreduce_gradients', 'allreduce_no_retain', 'autotp_size', 'autotuning_enabled',
    'autotuning_end_profile_step', 'autotuning_metric', 'autotuning_metric_path', 'autotuning_model_info_path',
    'autotuning_profile_model_info', 'autotuning_start_profile_step', 'backward',
    'bf16_master_weights_and_gradients', 'bf16_optimizer_states', 'bfloat16_enabled',
    'buffered_allreduce_fallback', 'checkpoint_serialization_enabled', 'checkpoint_tag_validation_enabled',
    'checkpoint_tag_validation_fail', 'checkpoint_writer_enabled', 'clip_fp32_gradients',
    'coalesce_grad_reduction', 'collect_python_gc', 'communication_data_type', 'compile', 'compile_autosp',
    'compile_autotp', 'compile_zero_optimization_stage', 'cpuadam_cores_perc', 'curriculum_learning_config',
    'curriculum_learning_enabled', 'data_efficiency_config', 'data_efficiency_enabled', 'data_sampling_config',
    'data_sampling_enabled', 'dataloader_drop_last', 'deepspeed_io', 'destroy', 'dump_state',
    'dynamic_loss_scale', 'dynamic_loss_scale_args', 'empty_partition_cache', 'eval', 'flops_profiler_detailed',
    'flops_profiler_enabled', 'flops_profiler_module_depth', 'flops_profiler_output_file',
    'flops_profiler_profile_step', 'flops_profiler_recompute_fwd_factor', 'flops_profiler_top_modules',
    'forward', 'fp16_auto_cast', 'fp16_enabled', 'fp16_master_weights_and_gradients', 'get_autosp_backend',
    'get_autotp_backend', 'get_batch_info', 'get_compile_time', 'get_data_parallel_rank', 'get_data_types',
    'get_deepcompile_backend', 'get_deepspeed_compile_backend', 'get_global_grad_norm', 'get_lr',
    'get_model_parallel_rank', 'get_mom', 'get_optimizer_configuration', 'get_sequence_parallel_group',
    'get_tensor_parallel_rank', 'get_type', 'get_wall_clock_timers', 'gradient_accumulation_steps',
    'gradient_clipping', 'gradient_predivide_factor', 'initial_dynamic_scale', 'is_compiled',
    'is_deepcompile_active', 'is_deepcompile_enabled', 'is_first_weights_partition_group',
    'is_gradient_accumulation_boundary', 'is_iterable_style_dataset', 'is_map_style_dataset',
    'is_sanity_checks_enabled', 'load_checkpoint', 'load_module_state_dict', 'load_moe_state_dict',
    'load_universal_checkpoint', 'log_level', 'loss_scale', 'managed_gradient_accumulation', 'memory_breakdown',
    'module_state_dict', 'no_sync', 'offload_states', 'optimizer_legacy_fusion', 'optimizer_name',
    'optimizer_params', 'postscale_gradients', 'print_forward_breakdown', 'random_ltd_config',
    'random_ltd_enabled', 'random_ltd_initialize', 'register_compile_pass', 'reload_states', 'save_16bit_model',
    'save_checkpoint', 'save_fp16_model', 'scale', 'scheduler_name', 'scheduler_params',
    'set_custom_curriculum_learning_schedule', 'set_data_post_process_func',
    'set_gradient_accumulation_boundary', 'set_train_batch_size', 'set_train_micro_batch_size',
    'sparse_all_gather', 'sparse_allreduce', 'sparse_allreduce_bucket', 'sparse_allreduce_no_retain', 'step',
    'steps_per_print', 'super_offload', 'swap_tensor_config', 'tensor_parallel_config', 'torch_autocast_dtype',
    'torch_autocast_enabled', 'torch_autocast_lower_precision_safe_modules', 'train', 'train_batch_size',
    'train_micro_batch_size_per_gpu', 'use_node_local_storage', 'uses_parallelization_pass_only',
    'wall_clock_breakdown', 'was_step_applied', 'zenflow_config', 'zero_allgather_bucket_size',
    'zero_allgather_partitions', 'zero_allgather_sequential', 'zero_allow_untested_optimizer',
    'zero_compute_grad_norm', 'zero_contiguous_gradients', 'zero_cpu_offload', 'zero_elastic_checkpoint',
    'zero_force_ds_cpu_optimizer', 'zero_gather_16bit_weights_on_model_save', 'zero_grad',
    'zero_hpz_partition_size', 'zero_ignore_unused_parameters', 'zero_legacy_stage1',
    'zero_load_from_fp32_weights', 'zero_log_trace_cache_warnings', 'zero_max_live_parameters',
    'zero_max_reuse_distance', 'zero_model_persistence_threshold', 'zero_module_granularity_threshold',
    'zero_multi_rank_bucket_allreduce', 'zero_nvme_offload_optimizer', 'zero_offload_optimizer',
    'zero_offload_param', 'zero_optimization', 'zero_optimization_partition_gradients',
    'zero_optimization_partition_weights', 'zero_optimization_stage', 'zero_overlap_comm',
    'zero_param_persistence_threshold', 'zero_parameter_alignment', 'zero_partial_offload',
    'zero_prefetch_bucket_size', 'zero_quantized_gradients', 'zero_quantized_nontrainable_weights',
    'zero_quantized_weights', 'zero_reduce_bucket_size', 'zero_reduce_scatter', 'zero_round_robin_gradients',
    'zero_save_muon_momentum_buffer_in_memory', 'zero_sub_group_size', 'zero_use_cpu_optimizer'
})

REFUSED: dict[str, str] = {name: why for why, names in _REASONS.items() for name in names}


def refusal(name: str) -> UnsupportedFeatureError:
    """The error for DeepSpeedEngine.<name> (an attribute, or a call with arguments the facade refuses)."""
    why = REFUSED.get(name, "a DeepSpeed tuning or internal getter with no zeroshard equivalent (the native "
                            "engine's settings: docs/ENGINE.md)")
    return _RefusedAttribute(f"DeepSpeedEngine.{name} (DeepSpeed feature) is not supported by "
                                       f"zeroshard.deepspeed: {why}")
