"""Interop with other checkpoint formats (toolkit side: never imports the training core).

  torch_pickle.py    reading foreign .pt pickles through torch's weights_only unpickler and a
                     closed allowlist of stand-ins for DeepSpeed's classes
  imported.py        Imported: a foreign checkpoint in memory, in zeroshard terms
  write.py           writing an Imported as a zeroshard checkpoint (the format writer)
  deepspeed_ckpt.py  reading DeepSpeed ZeRO 1/2/3 checkpoint folders
  dcp_metadata.py    reading torch.distributed.checkpoint `.metadata` (restricted unpickler)
  dcp_import.py      reading DCP checkpoints (FSDP2 model + optimizer) without a process group
  dcp_export.py      writing a zeroshard checkpoint as a DCP checkpoint

torch is imported inside functions only, so `import zeroshard.cli` stays light.
"""
