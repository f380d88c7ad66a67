"""Sample text from a consolidated checkpoint of the sample GPT.

    python samples/generate.py runs/gpt/model.safetensors --config runs/gpt/model_config.json

The weights file is one `.safetensors` file of full (unsharded) tensors, e.g. what the
zeroshard toolkit's consolidate writes. The model config and vocabulary come from the
model_config.json that samples/train_gpt.py writes into its --ckpt directory; by default it is
looked for beside the weights file and then in its parent directories. The weights load
into a plain `GPT` with `load_state_dict(strict=True)`: any missing or unexpected key is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `samples` package

from samples.data import CharTokenizer  # noqa: E402
from samples.gpt import GPT, GPTConfig  # noqa: E402

MODEL_CONFIG_FILE = "model_config.json"


def find_config(weights: Path) -> Path:
    for d in [weights.parent, *weights.parent.parents][:4]:
        if (d / MODEL_CONFIG_FILE).is_file():
            return d / MODEL_CONFIG_FILE
    raise SystemExit(f"no {MODEL_CONFIG_FILE} beside {weights} or above it; pass --config")


def load_model(weights: str | Path, config: str | Path | None = None) -> tuple[GPT, CharTokenizer]:
    """A plain GPT (fp32, eval mode) with the consolidated weights, and its tokenizer."""
    from safetensors.torch import load_file

    weights = Path(weights)
    meta = json.loads(Path(config or find_config(weights)).read_text())
    model = GPT(GPTConfig.from_dict(meta["model"]))
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    model.load_state_dict(state, strict=True)
    return model.eval(), CharTokenizer(meta["vocab"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", help="consolidated .safetensors file")
    p.add_argument("--config", default=None, help=f"{MODEL_CONFIG_FILE} written by train_gpt.py")
    p.add_argument("--prompt", default="The ", help="text to continue (characters must be in the vocabulary)")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--tokens", type=int, default=200, help="characters to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model, tok = load_model(args.weights, args.config)
    print(f"loaded {args.weights}: {model.num_params() / 1e6:.3f}M params, vocab {tok.vocab_size}, "
          f"config {model.config.to_dict()}")
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([tok.encode(args.prompt or "\n")] * args.samples, dtype=torch.long)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k or None,
                         generator=gen)
    for i, row in enumerate(out):
        print(f"--- sample {i}")
        print(tok.decode(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
