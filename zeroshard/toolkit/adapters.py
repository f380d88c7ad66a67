"""`zeroshard consolidate --peft`: a PEFT adapter folder that `peft.PeftModel.from_pretrained`
loads: adapter_model.safetensors (the adapter's tensors only) and adapter_config.json.

[Note: PEFT adapter names]
A PEFT model's state dict names an adapter's tensors with the adapter's name inside
(`base_model.model.fc.lora_A.default.weight`); PEFT's save_pretrained (peft 0.21,
get_peft_model_state_dict) writes them without it (`base_model.model.fc.lora_A.weight`). It picks
them structurally, from the live model; here they are picked by name, by the same rules:
  - tuner tensors: a segment starting with the method's prefix (`lora_`) followed by the
    adapter's name (`lora_A.default.weight`, `lora_B.default.bias`, DoRA's
    `lora_magnitude_vector.default.weight`, saved without its `.weight`);
  - modules_to_save copies: `head.modules_to_save.default.weight` is saved as `head.weight`;
  - trainable tokens: `emb.token_adapter.trainable_tokens_delta.default`;
  - the config's bias: "all" adds every `.bias`, "lora_only" the base layer's bias of each
    adapted module (`fc.base_layer.bias`);
then the adapter's name is removed as PEFT removes it (last or second-to-last segment only).
Not reproduced: PEFT's save_embedding_layers="auto", which also saves a targeted or resized
embedding's base weights; the adapter loads without them (the base model has its own).
"""

from __future__ import annotations

import json
import re

from zeroshard.errors import ZeroshardError
from zeroshard.format.manifest import Manifest
from zeroshard.toolkit.selection import OutputTensor

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = {"LORA": "lora_"}  # peft.mapping.PEFT_TYPE_TO_PREFIX_MAPPING, for the methods tested here
# safetensors' save orders tensors by dtype (this order) then name; PEFT's file is written by it
_SAFETENSORS_ORDER = {d: i for i, d in enumerate(("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                                                   "I16", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"))}


def adapter_output(url: str, manifest: Manifest, tensors: list[OutputTensor],
                   given: tuple[str, bytes, dict] | None) -> tuple[list[OutputTensor], bytes]:
    """The adapter's tensors under PEFT's names, and adapter_config.json's bytes: `given`
    (--adapter-config: its path, bytes, parsed JSON object), copied byte for byte, else the config
    the engine recorded at save (manifest extra["peft_config"])."""
    recorded = manifest.extra.get("peft_config")
    recorded = {k: v for k, v in recorded.items() if isinstance(v, dict)} if isinstance(recorded, dict) else {}
    config_file, given_bytes, config = given if given is not None else (None, None, None)
    if config_file is not None and "peft_type" not in config:
        raise ZeroshardError(f"{config_file}: --adapter-config must be PEFT's adapter_config.json (it has no "
                             f"peft_type)")
    if len(recorded) > 1 and config is None:
        raise ZeroshardError(f"{url}: the checkpoint holds {len(recorded)} PEFT adapters "
                             f"({', '.join(sorted(recorded))}); --peft writes 'default': give its adapter_config.json "
                             f"with --adapter-config FILE")
    if config is None:
        config = next(iter(recorded.values()), None)
    peft_type = str(config.get("peft_type")) if isinstance(config, dict) else "LORA"
    if peft_type not in _PREFIX:
        where = config_file or f"{url} (its recorded PEFT config)"
        raise ZeroshardError(f"{where}: --peft writes {', '.join(_PREFIX)} adapters, not peft_type {peft_type}")
    prefix = _PREFIX[peft_type]
    names = [t.name for t in tensors]
    adapter = next(iter(recorded)) if len(recorded) == 1 else _adapter_name(url, names, prefix)
    chosen = adapter_names(names, adapter, prefix, str((config or {}).get("bias", "none")))
    if not any(_tuner_segment(name.split("."), adapter, prefix) is not None for name in chosen.values()):
        raise ZeroshardError(f"{url}: the checkpoint holds no PEFT adapter tensors (no name like "
                             f"'*.{prefix}A.{adapter}.weight'); --peft exports the adapter of a PEFT model")
    if config is None:
        raise ZeroshardError(f"{url}: the checkpoint records no PEFT adapter config (an import, or an older "
                             f"zeroshard's save): give PEFT's adapter_config.json with --adapter-config FILE")
    by_name = {t.name: t for t in tensors}
    out = sorted((OutputTensor(key, by_name[name].source, by_name[name].dtype) for key, name in chosen.items()),
                 key=lambda t: (_SAFETENSORS_ORDER.get(t.dtype, len(_SAFETENSORS_ORDER)), t.name))
    # recorded: written as PeftConfig.save_pretrained writes it (no newline at the end)
    return out, given_bytes if given_bytes is not None else json.dumps(config, indent=2, sort_keys=True).encode()


def adapter_names(names: list[str], adapter: str, prefix: str, bias: str) -> dict[str, str]:
    """{PEFT's saved name: checkpoint name} of the adapter's tensors, in PEFT's order of choice (a
    later rule wins a name, as PEFT's dict updates do). See [Note: PEFT adapter names]."""
    saved: dict[str, str] = {}
    adapted: set[str] = set()  # modules holding the adapter's tuner tensors
    for name in names:
        parts = name.split(".")
        i = _tuner_segment(parts, adapter, prefix)
        if i is not None:
            adapted.add(".".join(parts[:i]))
            if parts[i:] == [f"{prefix}magnitude_vector", adapter, "weight"]:  # DoRA's, saved without .weight
                parts = parts[:-1]
            saved[".".join(parts)] = name
    for name in names:
        if (name == "bias" or name.endswith(".bias")) and (bias == "all" or (
                bias.endswith("_only") and name.endswith(".base_layer.bias")
                and name[:-len(".base_layer.bias")] in adapted)):
            saved[name] = name
    for name in names:  # the auxiliary wrappers: modules_to_save's trained copy stands for the module
        parts = name.split(".")
        if "modules_to_save" in parts[:-2] and parts[parts.index("modules_to_save") + 1] == adapter:
            i = parts.index("modules_to_save")
            saved[".".join(parts[:i] + parts[i + 2:])] = name
        elif parts[-2:] == ["trainable_tokens_delta", adapter]:
            saved[name] = name
    return {_without_adapter(key, adapter): name for key, name in saved.items()}


def _tuner_segment(parts: list[str], adapter: str, prefix: str) -> int | None:
    """The index of the tuner segment (`lora_A` in `fc.lora_A.default.weight`), else None."""
    for i in range(max(len(parts) - 3, 0), len(parts) - 1):
        if parts[i].startswith(prefix) and parts[i + 1] == adapter:
            return i
    return None


def _without_adapter(key: str, adapter: str) -> str:
    """peft.tuners.tuners_utils._remove_adapter_name_from_state_dict_key, as in peft 0.21."""
    if "." not in key:
        return key
    if key.endswith(f".{adapter}"):
        return key[: -len(adapter) - 1]
    key, _, suffix = key.rpartition(".")
    return f"{re.sub(re.escape(f'.{adapter}') + r'$', '', key)}.{suffix}"


def _adapter_name(url: str, names: list[str], prefix: str) -> str:
    """The adapter's name when no config records it: the one that follows every tuner segment."""
    found = sorted({parts[i + 1] for parts in (n.split(".") for n in names)
                    for i in range(max(len(parts) - 3, 0), len(parts) - 1) if parts[i].startswith(prefix)})
    if len(found) > 1 and "default" not in found:
        raise ZeroshardError(f"{url}: the checkpoint holds the tensors of {len(found)} PEFT adapters "
                             f"({', '.join(found)}); --peft writes one adapter, named 'default'")
    return "default" if len(found) != 1 else found[0]
