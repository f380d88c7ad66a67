"""MoE names that scripts import even without MoE; zeroshard has no expert parallelism."""
