"""Two LoRA adapters served alternately: multi-LoRA serving through ``cachebuild.compile``.

The Llama of ``llama.py`` with two peft LoRA adapters, ``a`` and ``b``, on its attention
and MLP projections. A server switches the active adapter between requests
(``set_adapter``); the compiled module notices before the next call runs (the adapter's
name is a value the trace read) and serves that request with the forward for that adapter:
traced and built the first time an adapter is seen, taken from the store on every later
start, and kept in the process, so switching back costs nothing. Disabling, merging and
unmerging an adapter are followed the same way; loading new adapter weights in place needs
nothing.

Needs ``pip install peft``. The size knobs are ``llama.py``'s (``LLAMA_LAYERS``, ...,
``LLAMA_BACKEND``); ``LORA_REQUESTS`` (8) requests alternate between the adapters;
``LORA_DOOR=torch`` serves through ``torch.compile(model, backend=cachebuild.backend())``;
``LORA_WARM`` names the adapter ``build()`` leaves active (``a``): ``warm`` builds the
forward of the model as ``build()`` returns it, so each adapter is warmed by a ``warm`` of
its own.

    cachebuild warm examples/lora.py                 # adapter a's forward, ahead of time
    LORA_WARM=b cachebuild warm examples/lora.py     # and b's (else the first b request traces)
    python examples/lora.py                # serve a, b, a, b, ...; exit 1 unless equal to eager
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (the model the adapters go on)

import cachebuild  # noqa: E402

TARGETS = ["qkv", "o_proj", "gate_up", "down"]


def make_model(active: str = "a") -> torch.nn.Module:
    """The Llama with adapters ``a`` and ``b``, each with weights of its own, ``active``
    the active one."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = llama.make_model()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                            init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=32, target_modules=TARGETS,
                                      init_lora_weights=False))
    model.set_adapter(active)
    return model.to(base.embed.weight.dtype).eval()


def build() -> cachebuild.ModelSpec:
    adapter = os.environ.get("LORA_WARM", "a")
    if adapter not in ("a", "b"):
        raise ValueError(f"LORA_WARM={adapter!r}: the adapters are 'a' and 'b'")
    model = make_model(adapter)
    return cachebuild.ModelSpec(model, llama.example_inputs(model.get_base_model()),
                                {0: 0, 1: 0}, llama.config())


def main() -> None:
    """Serve requests alternating between the adapters; every output checked against
    the eager model with the same adapter."""
    model = make_model()
    if os.environ.get("LORA_DOOR") == "torch":  # torch.compile's door: Dynamo's guards
        compiled = torch.compile(model, backend=cachebuild.backend(llama.config()),
                                 dynamic=False)
    else:
        compiled = cachebuild.compile(model, llama.config(), dynamic_dims={0: 0, 1: 0})
    ids, pos = llama.example_inputs(model.get_base_model(), tokens=16)
    tolerance = 2e-2 if ids.is_cuda else 1e-4
    wrong = 0
    for i in range(int(os.environ.get("LORA_REQUESTS", 8))):
        adapter = "ab"[i % 2]
        model.set_adapter(adapter)
        start = time.perf_counter()
        with torch.no_grad():
            out = compiled(ids, pos)
            seconds = time.perf_counter() - start
            want = model(ids, pos)
        error = float((out.float() - want.float()).abs().max())
        wrong += error > tolerance
        s = cachebuild.stats()
        print(f"request {i} adapter {adapter}: {seconds * 1e3:8.1f} ms, max error {error:.1e}; "
              f"so far traced {s['traced']}, built {s['built']}, switched {s['variant_switches']}",
              file=sys.stderr)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
