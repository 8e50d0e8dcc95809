"""Models whose compiled code depends on process-wide settings Inductor reads while it
generates code (``compat.codegen_settings``), run as a script by
``test_codegen_settings.py``: ``python codegen_models.py MODEL SETTING BACKEND`` compiles
MODEL in a process that made SETTING, calls it, and prints one JSON line comparing it
with eager."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import cachebuild


class Unset(nn.Module):
    """Returns memory ``torch.empty`` left unset: deterministic algorithms fill it with
    NaN, in eager and in code Inductor generated under them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], 16)
        out[:, :8] = self.lin(x)
        return out.relu() + 1


class Wide(nn.Module):
    """Matmuls wide enough for oneDNN, whose float32 precision a process may lower."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


SETTINGS = {
    "default": lambda: None,
    "deterministic": lambda: torch.use_deterministic_algorithms(True),
    "onednn bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    "tf32": lambda: torch.set_float32_matmul_precision("high"),
}


def main(model_name: str, setting: str, backend: str) -> None:
    SETTINGS[setting]()
    torch.manual_seed(0)
    model = {"unset": Unset, "wide": Wide}[model_name]().eval()
    config = cachebuild.CompileConfig(backend=backend, compile_ranges=((1, 16),),
                                      while_building="wait")
    compiled = cachebuild.compile(model, config=config, dynamic_dims={0: 0})
    x = torch.randn(4, 8 if model_name == "unset" else 256)
    with torch.no_grad():
        out, want = compiled(x), model(x)
    same_nan = bool((out.isnan() == want.isnan()).all())
    error = float((out - want).nan_to_num(0.0).abs().max())
    stats = cachebuild.stats()
    print(json.dumps({"error": error, "same_nan": same_nan, "nan": int(want.isnan().sum()),
                      "traced": stats["traced"], "built": stats["built"]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
