"""get_accelerator(): DeepSpeed's accelerator object, for CUDA and CPU only."""

from __future__ import annotations

import torch

from zeroshard.errors import ConfigError


class Accelerator:
    def __init__(self, name: str) -> None:
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """CUDA when available, else CPU (DeepSpeed's DS_ACCELERATOR=cpu|cuda is honoured)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        import os

        wanted = os.environ.get("DS_ACCELERATOR")
        if wanted not in (None, "cpu", "cuda"):
            raise ConfigError(f"DS_ACCELERATOR={wanted!r}: zeroshard supports 'cuda' and 'cpu'")
        _ACCELERATOR = Accelerator(wanted or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _ACCELERATOR
