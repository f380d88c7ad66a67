"""consolidate --peft (issue 54): a PEFT adapter folder out of a zeroshard checkpoint, as PEFT's
own save_pretrained writes it (adapter_model.safetensors with the adapter's tensors only, the
adapter name taken out of their names; adapter_config.json), so PeftModel.from_pretrained loads
it. From a native ZeRO-3 run (the config recorded at save), from imported DeepSpeed checkpoints
written by the HF Trainer (the config given), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main

from checkpoints import write_checkpoint
from distributed import run_ranks

TIER = "mixed"  # docs/TESTING.md

DEEPSPEED = Path(__file__).parent / "data" / "deepspeed"
LORA = {"target_modules": ["q_proj", "v_proj"], "r": 2, "lora_alpha": 4, "init_lora_weights": False}
VOCAB, SEQ = 32, 6


def consolidate(*args: str):
    return CliRunner().invoke(main, ["consolidate", "-q", *args])


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """The base model: a two-layer Llama built from its config (no download), weights from `seed`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def peft_llama() -> torch.nn.Module:
    """The base from seed 0, LoRA on q/v from seed 1 (random B too, so every adapter tensor matters)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(0)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(**LORA))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))


def train_and_save(rank: int, world_size: int, root: str) -> dict:
    """Three AdamW steps over the adapters at ZeRO-3, a save, then the trained model's logits."""
    import zeroshard

    model = peft_llama()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = zeroshard.initialize(model, torch.optim.AdamW(trainable, lr=1e-2), {"zero_optimization": {"stage": 3}})
    for step in range(3):
        x = tokens(10 * step + rank)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    url = engine.save_checkpoint(root)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=tokens(99)).logits
    return {"url": url, "logits": logits, "state": engine.full_state_dict()}


@pytest.mark.slow  # peft and transformers start in both ranks: ~17 s on 2 loaded cores
@pytest.mark.timeout(240)
def test_a_native_zero3_peft_run_exports_an_adapter_peft_loads_with_the_trained_logits(tmp_path):
    """A LoRA Llama trained at ZeRO-3 on 2 ranks and saved: consolidate --peft writes the adapter
    with the config recorded at save. PeftModel.from_pretrained on a fresh base gives the ranks'
    logits exactly; the safetensors file is byte for byte PEFT's own save_pretrained of the trained
    model, and the config its adapter_config.json (sets sorted). --dtype bf16 casts the tensors."""
    pytest.importorskip("peft", reason="peft is not installed (tools/dev.sh test --all installs it)")
    from peft import PeftModel
    from safetensors.torch import load_file

    got = run_ranks(train_and_save, 2, timeout=200, root=str(tmp_path / "run"))[0]
    out = tmp_path / "adapter"
    result = consolidate(got["url"], str(out), "--peft")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    loaded = PeftModel.from_pretrained(tiny_llama(0), str(out)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens(99)).logits, got["logits"])

    theirs = tmp_path / "peft_own"  # PEFT's own save of the trained model
    trained = peft_llama()
    trained.load_state_dict(got["state"], strict=True)
    trained.save_pretrained(str(theirs))
    ours_tensors, their_tensors = load_file(out / "adapter_model.safetensors"), load_file(
        theirs / "adapter_model.safetensors")
    assert set(ours_tensors) == set(their_tensors) and len(ours_tensors) == 8, sorted(ours_tensors)
    assert all(".default." not in name for name in ours_tensors)
    assert (out / "adapter_model.safetensors").read_bytes() == (theirs / "adapter_model.safetensors").read_bytes()
    ours_config = json.loads((out / "adapter_config.json").read_text())
    their_config = json.loads((theirs / "adapter_config.json").read_text())
    their_config["target_modules"] = sorted(their_config["target_modules"])  # PEFT writes a set in hash order
    assert ours_config == their_config
    assert ours_config["inference_mode"] is True
    assert ours_config["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"

    half = tmp_path / "bf16"
    assert consolidate(got["url"], str(half), "--peft", "--dtype", "bf16").exit_code == 0
    cast = load_file(half / "adapter_model.safetensors")
    assert all(torch.equal(cast[n], t.to(torch.bfloat16)) for n, t in their_tensors.items()) and len(cast) == 8


PEFT_VARIANTS = {
    "modules_to_save + lora_only bias": {"bias": "lora_only", "modules_to_save": ["head"]},
    "DoRA + all biases": {"bias": "all", "use_dora": True},
    "modules_to_save + all biases": {"bias": "all", "modules_to_save": ["head"]},
    "lora_bias + trainable tokens": {"lora_bias": True, "trainable_token_indices": {"emb": [1, 2]}},
}


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.emb(x)))


@pytest.mark.slow  # PEFT (and the Accelerate it needs) are set up by tools/dev.sh test --all only
@pytest.mark.parametrize("variant", sorted(PEFT_VARIANTS))
def test_names_follow_peft_for_its_other_saved_tensors(tmp_path, variant):
    """modules_to_save copies, DoRA's magnitude, biases, lora_B's bias and trainable tokens: the
    file consolidate --peft writes from a checkpoint of the PEFT model's state dict is the one
    PEFT's save_pretrained writes, byte for byte (names, dtypes, shapes, values)."""
    pytest.importorskip("peft", reason="peft is not installed (tools/dev.sh test --all installs it)")
    from peft import LoraConfig, get_peft_model

    from zeroshard.checkpointing.model_config import peft_config_of
    from zeroshard.format import TensorSpec
    from zeroshard.storage import dtype_name

    torch.manual_seed(0)
    model = get_peft_model(Small(), LoraConfig(target_modules=["fc"], r=2, init_lora_weights=False,
                                               **PEFT_VARIANTS[variant]))
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    specs = [TensorSpec(n, "param", dtype_name(t.dtype), tuple(t.shape), "flat") for n, t in state.items()]
    write_checkpoint(str(tmp_path / "ckpt"), specs, state, 2, extra={"peft_config": peft_config_of(model)})
    result = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "ours"), "--peft")
    assert result.exit_code == 0, result.output
    model.save_pretrained(str(tmp_path / "theirs"))
    ours, theirs = (tmp_path / side / "adapter_model.safetensors" for side in ("ours", "theirs"))
    assert ours.read_bytes() == theirs.read_bytes(), (variant, ours.read_bytes()[:400], theirs.read_bytes()[:400])


@pytest.mark.parametrize("variant", ["hf_trainer_lora", "hf_trainer_lora_stage3"])
def test_an_imported_deepspeed_peft_checkpoint_exports_peft_s_own_adapter_file(tmp_path, variant):
    """The HF Trainer's DeepSpeed checkpoints of a PEFT model (tests/data/deepspeed, written by
    DeepSpeed 0.19.8 at ZeRO 2 and 3, PEFT 0.21.2): imported, then consolidate --peft with the
    adapter_config.json the Trainer saved beside writes PEFT's own adapter_model.safetensors of the
    same step byte for byte, and the config as given. An import records no config: refused without."""
    src = DEEPSPEED / variant / "checkpoint-3"
    ckpt, out = tmp_path / "imported", tmp_path / "adapter"
    assert CliRunner().invoke(main, ["import", "deepspeed", str(src.parent), str(ckpt), "-q"]).exit_code == 0
    result = consolidate(str(ckpt), str(out), "--peft")
    assert result.exit_code == 1 and "records no PEFT adapter config" in result.output, result.output
    assert "--adapter-config FILE" in result.output and not out.exists()
    result = consolidate(str(ckpt), str(out), "--peft", "--adapter-config", str(src / "adapter_config.json"))
    assert result.exit_code == 0, result.output
    assert (out / "adapter_model.safetensors").read_bytes() == (src / "adapter_model.safetensors").read_bytes()
    assert (out / "adapter_config.json").read_bytes() == (src / "adapter_config.json").read_bytes()


def plain_checkpoint(folder: Path, names: list[str], **fields) -> None:
    data = {name: torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i, name in enumerate(names)}
    specs = [_spec(n, t) for n, t in data.items()]
    write_checkpoint(str(folder), specs, data, 2, **fields)


def _spec(name: str, tensor: torch.Tensor):
    from zeroshard.format import TensorSpec

    return TensorSpec(name, "param", "F32", tuple(tensor.shape), "flat")


ADAPTER = ["base_model.model.fc.base_layer.weight", "base_model.model.fc.lora_A.default.weight",
           "base_model.model.fc.lora_B.default.weight"]


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    """No adapter tensors; no config recorded and none given; a config that is not PEFT's; another
    PEFT method; a .safetensors OUT, --max-shard-size or --config with --peft; --adapter-config
    without --peft. Each one line naming what is wrong, nothing written."""
    plain, lora, adalora = tmp_path / "plain", tmp_path / "lora", tmp_path / "ia3"
    plain_checkpoint(plain, ["fc.weight", "head.weight"], extra={"peft_config": {"default": {"peft_type": "LORA"}}})
    plain_checkpoint(lora, ADAPTER)
    plain_checkpoint(adalora, ADAPTER, extra={"peft_config": {"default": {"peft_type": "IA3"}}})
    not_peft, peft_config = tmp_path / "config.json", tmp_path / "adapter_config.json"
    not_peft.write_text('{"model_type": "llama"}')
    peft_config.write_text('{"peft_type": "LORA", "r": 2}')
    out = tmp_path / "out"
    for args, needle in (
            ([plain, out, "--peft"], "holds no PEFT adapter tensors (no name like '*.lora_A.default.weight')"),
            ([lora, out, "--peft"], "records no PEFT adapter config"),
            ([lora, out, "--peft", "--adapter-config", not_peft], "must be PEFT's adapter_config.json"),
            ([lora, out, "--peft", "--adapter-config", tmp_path / "missing.json"], "cannot read the --adapter-config"),
            ([adalora, out, "--peft"], "--peft writes LORA adapters, not peft_type IA3"),
            ([lora, tmp_path / "a.safetensors", "--peft", "--adapter-config", peft_config],
             "--peft writes an adapter folder"),
            ([lora, out, "--peft", "--adapter-config", peft_config, "--max-shard-size", "1KB"],
             "drop --max-shard-size"),
            ([lora, out, "--peft", "--config", not_peft], "give it with --adapter-config, not --config"),
            ([lora, out, "--adapter-config", peft_config], "--adapter-config goes with --peft")):
        result = consolidate(*map(str, args))
        assert result.exit_code == 1, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.startswith("zeroshard: error:")]
        assert len(lines) == 1 and needle in lines[0], (args, result.output)
        assert "Traceback" not in result.output
        assert not out.exists() and not (tmp_path / "a.safetensors").exists()

    result = consolidate(str(lora), str(out), "--peft", "--adapter-config", str(peft_config))
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    assert sorted(load_file(out / "adapter_model.safetensors")) == ["base_model.model.fc.lora_A.weight",
                                                                    "base_model.model.fc.lora_B.weight"]
    assert (out / "adapter_config.json").read_bytes() == peft_config.read_bytes()
