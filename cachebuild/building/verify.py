"""Targets proven before they are stored: the compiled artifact against its own piece.

A target's key is meant to cover everything that decides its output; a factor it misses
would turn into a wrong answer unnoticed. So before a target is stored, its artifact is
loaded and run at sizes of its bucket (the size hint, and a range's ends) on random
inputs, and compared with the piece's own graph run eagerly on the same inputs, within
the output dtype's tolerance. ``CACHEBUILD_VERIFY=load`` runs the same check on the first
load of each target in a process; that check needs neither Dynamo nor Inductor.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cachebuild import keep
from cachebuild.backends.protocol import (
    Artifact,
    Backend,
    bucket_bounds,
    example_inputs,
    size_hint,
)
from cachebuild.graph.facts import InputMeta, device_of
from cachebuild.graph.inputs import copy_with_strides
from cachebuild.store.interface import ArtifactSource
from cachebuild.trust.fxjson import data_to_module

#: Relative tolerance per output dtype: the rounding of reordered or fused arithmetic.
#: The absolute tolerance is the same share of the reference's largest magnitude.
TOLERANCE = {
    torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2,
}
FP8_TOLERANCE = 0.13  # one step of e4m3's 3-bit mantissa (12.5%) either way


class Mismatch(Exception):
    """The artifact's output differs from its piece's (message: where and by how much)."""


def verify_sizes(bucket: dict[str, Any]) -> list[int | None]:
    """The sizes a target is run at: its hint and, for a range, both ends."""
    hint = size_hint(bucket)
    bounds = bucket_bounds(bucket)
    if bounds is None:
        return [hint]
    return sorted({hint, *bounds})


def tolerance(dtype: torch.dtype) -> float | None:
    """Relative tolerance for outputs of ``dtype`` (None: must be exactly equal)."""
    if dtype in TOLERANCE:
        return TOLERANCE[dtype]
    if dtype.is_floating_point:  # float8 variants
        return FP8_TOLERANCE
    return None


def input_tolerance(metas: Sequence[InputMeta]) -> float:
    """The loosest tolerance of the floating inputs in ``metas`` (0 without any): what an
    output computed from them may differ by whatever its own dtype (a float32 softmax of
    bfloat16 values carries bfloat16's error)."""
    return max((tolerance(getattr(torch, m.dtype)) or 0.0 for m in metas
                if m.kind == "tensor" and getattr(torch, m.dtype).is_floating_point),
               default=0.0)


def compare(out: Any, ref: Any, what: str, floor: float = 0.0) -> None:
    """Raise Mismatch unless ``out`` matches ``ref`` (a tensor or a non-tensor value); a
    floating tensor within its dtype's tolerance, or ``floor`` where that is looser."""
    if not isinstance(ref, torch.Tensor):
        if out != ref:
            raise Mismatch(f"{what} is {out!r}, expected {ref!r}")
        return
    if not isinstance(out, torch.Tensor):
        raise Mismatch(f"{what} is {type(out).__name__}, expected a tensor")
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise Mismatch(f"{what} is {out.dtype} {list(out.shape)}, expected {ref.dtype} "
                       f"{list(ref.shape)}")
    tol = tolerance(ref.dtype)
    if tol is not None:
        tol = max(tol, floor)
    if tol is None:
        if not torch.equal(out, ref):
            raise Mismatch(f"{what} differs in {int((out != ref).sum())} elements")
        return
    a, b = out.float(), ref.float()
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    if not torch.allclose(a, b, rtol=tol, atol=tol * max(scale, 1e-6), equal_nan=True):
        diff = (a - b).abs().nan_to_num(float("inf"))
        raise Mismatch(f"{what} differs by up to {float(diff.max()):.3g} (tolerance "
                       f"{tol:g} of {scale:.3g})")


def _clone(values: Sequence[Any]) -> list[Any]:
    # With its strides: the artifact, built for the strides its piece was traced with,
    # would read a dense copy of a slice wrongly.
    return [copy_with_strides(v) if isinstance(v, torch.Tensor) else v for v in values]


def _flat(outputs: Any) -> list[Any]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def check(fn: Any, nodes: list[dict[str, Any]], metas: list[InputMeta],
          bucket: dict[str, Any], seed: int = 0) -> list[int | None]:
    """Run ``fn`` and the piece's graph (eagerly) at each size of ``verify_sizes(bucket)``
    on the same random inputs; raise Mismatch at the first difference, in an output or in
    an input after the call (what each wrote in place). Returns the sizes.

    Integer inputs hold distinct values first (indices that never repeat, so writes through
    them have one right result); where the piece rejects that, one input at a time holds
    0s and 1s instead, then all of them. A size at which the piece rejects every one of
    those (an index out of range) proves nothing either way and is skipped; so does one
    where only repeated indices are accepted and the piece writes through indices
    (``index_copy_``, ``x[ids] = v``): which of two writes to one place lands is left to
    the kernel, in eager too (a 32-row cache written at 8192 positions).
    """
    reference = data_to_module(nodes)
    sizes = verify_sizes(bucket)
    ints = [i for i, m in enumerate(metas)
            if m.kind == "tensor" and not getattr(torch, m.dtype).is_floating_point
            and m.dtype != "bool"]
    regimes = [set(ints), *({*ints} - {i} for i in ints), set()] if ints else [set()]
    if writes_through_indices(nodes):
        regimes = regimes[:1]
    floor = input_tolerance(metas)
    with keep.rng():
        for size in sizes:
            for distinct in regimes:
                torch.manual_seed(seed + (size or 0))
                inputs = example_inputs(metas, bucket, size, distinct=distinct)
                ref_inputs, out_inputs = _clone(inputs), _clone(inputs)
                # Both from one state of torch's generators, which each must leave alike:
                # a piece that draws random numbers draws eager's.
                drawn_from = _generator_states(metas)
                with torch.no_grad():
                    try:
                        # forward itself: GraphModule's __call__ prints the error of a
                        # size the piece rejects to stderr, which is no error here
                        ref = _flat(reference.forward(*ref_inputs))
                    except Exception:
                        continue
                    ref_left = _generator_states(metas)
                    _set_generator_states(metas, drawn_from)
                    out = _run(fn, out_inputs, size)
                _compare_all(out, ref, out_inputs, ref_inputs, size, floor)
                if not all(map(torch.equal, _generator_states(metas), ref_left)):
                    raise Mismatch(f"at size {size}: torch's random number generator is left "
                                   "in another state than eager leaves it (the artifact drew "
                                   "other random numbers)")
                break
    return sizes


#: Operators whose writes through an index tensor land in an order the kernel picks where
#: an index repeats (by the name stored graphs call them, in every form: ``aten::`` op,
#: ``torch`` function, Tensor method, ``operator.setitem``; leading and trailing ``_``
#: dropped).
LAST_WRITE_WINS = frozenset({"index_copy", "index_put", "unsafe_index_put", "index_put_impl",
                             "scatter", "put", "setitem"})


def writes_through_indices(nodes: list[dict[str, Any]]) -> bool:
    """Whether a node of the stored graph ``nodes`` calls one of ``LAST_WRITE_WINS``."""
    for node in nodes:
        target = node.get("target")
        if node.get("op") not in ("call_function", "call_method") or not isinstance(target, str):
            continue
        if target.rsplit(":", 1)[-1].split(".", 1)[0].strip("_") in LAST_WRITE_WINS:
            return True
    return False


def _cuda_devices(metas: Sequence[InputMeta]) -> list[int]:
    return sorted({torch.device(m.device).index or 0 for m in metas
                   if m.kind == "tensor" and m.device.startswith("cuda")})


def _generator_states(metas: Sequence[InputMeta]) -> list[torch.Tensor]:
    """The states of torch's CPU generator and of the CUDA devices ``metas`` are on."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in _cuda_devices(metas))]


def _set_generator_states(metas: Sequence[InputMeta], states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    for device, state in zip(_cuda_devices(metas), states[1:], strict=True):
        torch.cuda.set_rng_state(state, device)


def _run(fn: Any, inputs: list[Any], size: int | None) -> list[Any]:
    try:
        return _flat(fn(*inputs))
    except Exception as e:
        raise Mismatch(f"at size {size}: the artifact raised {type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e


def _compare_all(out: list[Any], ref: list[Any], out_inputs: list[Any], ref_inputs: list[Any],
                 size: int | None, floor: float) -> None:
    if len(out) != len(ref):
        raise Mismatch(f"at size {size}: {len(out)} outputs, expected {len(ref)}")
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        compare(o, r, f"at size {size}, output {i}", floor)
    for i, (o, r) in enumerate(zip(out_inputs, ref_inputs, strict=True)):
        if isinstance(r, torch.Tensor):
            compare(o, r, f"at size {size}, input {i} after the call (written in place)", floor)


@dataclass
class ScratchStore(ArtifactSource):
    """One artifact in a private folder, readable the way backends read a store."""

    key: str
    artifact: Artifact
    folder: Path

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The artifact's payload (nothing else is held; nothing counts a use)."""
        return self.artifact.payload if key == self.key else None

    def contains(self, key: str) -> bool:
        return key == self.key

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        """A private directory for the loader's files: inside this store's own temporary
        folder (0700, removed with it), on disk or not as that folder is."""
        path = self.folder / "scratch"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def materialize(self, key: str, suffix: str) -> Path | None:
        """The payload in a file of the folder (0500), made on the first call."""
        if key != self.key:
            return None
        path = self.folder / f"{key}{suffix}"
        if not path.exists():
            path.write_bytes(self.artifact.payload)
            os.chmod(path, 0o500)
        return path


def check_artifact(backend: Backend, artifact: Artifact, key: str, nodes: list[dict[str, Any]],
                   metas: list[InputMeta], bucket: dict[str, Any]) -> list[int | None]:
    """Load ``artifact`` as the backend would from a store and ``check`` it."""
    device = device_of(metas)
    with tempfile.TemporaryDirectory(prefix="cachebuild-verify-") as folder:
        fn = backend.load(artifact.kind, key, ScratchStore(key, artifact, Path(folder)), device)
        if fn is None:
            raise Mismatch("the artifact does not load")
        return check(fn, nodes, metas, bucket)


def verify_on_load() -> bool:
    """True if ``CACHEBUILD_VERIFY=load`` asks for the check on first load, too."""
    value = os.environ.get("CACHEBUILD_VERIFY", "")
    if value not in ("", "load", "build"):
        from cachebuild.errors import UsageError

        raise UsageError(f"CACHEBUILD_VERIFY={value!r}: use 'load' (check targets on first load "
                         "as well), or 'build' or leave it unset (at build only)")
    return value == "load"
