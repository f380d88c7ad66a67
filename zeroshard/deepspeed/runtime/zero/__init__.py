"""deepspeed.runtime.zero: partition_parameters.ZeroParamStatus (Init and GatheredParameters are
in zeroshard.deepspeed.zero, where scripts import them from as `deepspeed.zero`)."""
