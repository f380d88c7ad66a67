"""Interop with other checkpoint formats (toolkit side: never imports the training core).

  files.py           the readers' only way to files: storage's Location (local or s3://), with
                     the local refusals (links out of the folder, FIFOs, devices) kept
  torch_pickle.py    reading foreign .pt pickles through torch's weights_only unpickler and a
                     closed allowlist of stand-ins for DeepSpeed's classes
  torch_zip.py       torch.save zip archives read by record: big tensors are LazyTensors that
                     read only the bytes of the range asked for (files or byte ranges of files),
                     or StoredTensors that say where their bytes lie
  imported.py        Imported: a foreign checkpoint, in zeroshard terms; LazyTensor, Flat
  write.py           writing an Imported as a zeroshard checkpoint (the format writer)
  deepspeed_ckpt.py  reading DeepSpeed ZeRO 1/2/3 checkpoint folders (deepspeed_common.py: what
                     every layout shares; deepspeed_universal.py: ds_to_universal folders)
  dcp_metadata.py    reading torch.distributed.checkpoint `.metadata` (restricted unpickler)
  dcp_import.py      reading DCP checkpoints (FSDP2 model + optimizer) without a process group
  dcp_export.py      writing a zeroshard checkpoint as a DCP checkpoint (local or s3://)
  megatron.py        Megatron-Core's torch_dist dist_checkpointing folders (weights; stacked layers)
  pickled_state.py   a torch.save'd full state dict (Accelerate's FULL_STATE_DICT) as DCP keys
  pickled_model.py   a torch.save'd full model (pytorch_model.bin, model.pt) as byte ranges, for
                     `shard` and `load_pretrained` (safetensors ones: format/full_model.py)
  trainer_ddp.py     the HF Trainer's checkpoint without DeepSpeed/FSDP (model.safetensors +
                     optimizer.pt by index, named through the model class) as DCP keys
  beside.py          what Accelerate and the HF Trainer save beside the weights: schedulers,
                     registered objects, trainer_state.json carried; the rest named
  rng_states.py      their per-process RNG files as each rank's RNG state
  hf_folders.py      the names of those saves, and of the Trainer's checkpoint-N folders
  source.py          what an import source is: recognise its folder, read it, its CLI options
  sources.py         the import sources in one list (`zeroshard import NAME`, foreign-folder
                     hints, resolve_checkpoint's errors ask it); adding one: sources.py's docstring

torch is imported inside functions only, so `import zeroshard.cli` stays light.
"""

from zeroshard.interop import sources  # noqa: F401  format's foreign-folder describer: See [Note: foreign folders]
