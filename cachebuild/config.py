"""CompileConfig and PassConfig: what the user decides about compilation, validated once.

Both are plain values: building one imports no torch, no backend and no pass. Every field
is named and documented here; ``factors()`` is what enters the entry key, and the subset
that decides a compiled piece enters every target key (``targets.py``). The backend name
is checked where the backend is resolved (``cachebuild.backends.get_backend``), the only
place that knows every registered one.

Sizes are bounded (``MAX_SIZE``, and how many of each a config may list), and option
values must be finite. ``inductor_options`` names are checked against Inductor's config
(``check_inductor_options``) at once when Inductor's config module is loaded already, and
otherwise before the first trace or build: importing it costs seconds (measured: about 3 s
on top of ``import torch`` on a CPU machine), which a warm start must not pay.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
import os
import re
import sys
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, fields, replace
from typing import Any

from cachebuild.errors import ConfigError

#: Splitting ops are named like torch's operator registry does: ``namespace::name`` with
#: an optional ``.overload`` (``mylib::attention``, ``aten::scaled_dot_product_attention``).
OP_NAME = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")

FLAVOURS = ("auto", "aoti", "standalone")
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise", "full_decode_only")
#: The most sequences a decode batch has by default (vLLM's default ``max_num_seqs``): the
#: capture sizes up to it get full graphs for decode calls unless ``decode_sizes`` says.
DEFAULT_MAX_DECODE = 256
#: When sizes are captured (``capture.py``): ``auto`` is background on CUDA, lazy elsewhere.
CAPTURE_POLICIES = ("auto", "eager", "background", "lazy")
OUT_OF_RANGE = ("error", "eager")
#: What a cold start serves with while its targets build (``while_building``).
WHILE_BUILDING = ("auto", "wait", "eager_fusion", "standalone")
ON_FAILURE = ("error", "eager")
#: Fields that decide how a loaded model runs, not what is built or stored.
RUNTIME_ONLY = ("cudagraph_mode", "capture", "capture_sizes", "decode_sizes",
                "pad_to_capture_size",
                "out_of_range", "on_failure", "while_building")
#: The largest size of a dynamic dim a config may name (what a 32-bit index reaches).
MAX_SIZE = 2**31 - 1
#: How many ranges, exact sizes and capture sizes a config may list.
MAX_RANGES = 256
MAX_COMPILE_SIZES = 256
MAX_CAPTURE_SIZES = 4096


def default_capture_sizes() -> tuple[int, ...]:
    """1, 2, 4, then 8…248 by 8, then 256…512 by 16: 51 sizes."""
    return (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


@dataclass(frozen=True)
class PassConfig:
    """Which built-in fusion passes run. Every fusion is off by default; clean-up is on.

    - ``rms_quant``: RMSNorm followed by fp8 quantisation, as one kernel.
    - ``add_rms_quant``: residual add, RMSNorm and fp8 quantisation, as one kernel.
    - ``act_quant``: SiLU-and-multiply followed by fp8 quantisation, as one kernel.
    - ``qk_norm_rope``: per-head RMSNorm of q and k followed by rotary embedding.
    - ``cleanup``: drop no-op reshapes, slices and copies the rewrites leave behind.
    """

    rms_quant: bool = False
    add_rms_quant: bool = False
    act_quant: bool = False
    qk_norm_rope: bool = False
    cleanup: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ConfigError(f"PassConfig.{f.name} must be a bool, got {value!r}")

    @classmethod
    def all_fusions(cls) -> PassConfig:
        """A config with every fusion and the clean-up enabled."""
        return cls(rms_quant=True, add_rms_quant=True, act_quant=True, qk_norm_rope=True)

    def factors(self) -> dict[str, bool]:
        """The flags by name: what enters a key."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def enabled(self) -> list[str]:
        """Names of the enabled flags, in declaration order."""
        return [name for name, on in self.factors().items() if on]


@dataclass(frozen=True)
class CompileConfig:
    """How a model is compiled.

    - ``splitting_ops``: ops the graph is cut at; they run eagerly between pieces.
    - ``compile_ranges``: inclusive ``(lo, hi)`` ranges of the dynamic dim; each range
      gets one target per piece, valid for every size in it.
    - ``compile_sizes``: exact sizes that get their own specialised target; each must
      lie inside a range.
    - ``backend``: ``"inductor"``, ``"eager_fusion"``, or a registered plug-in backend
      (checked when the backend is resolved).
    - ``flavour``: the inductor artifact kind: ``"auto"`` (AOTInductor where it loads
      here, else standalone), ``"aoti"`` or ``"standalone"``.
    - ``passes``: a ``PassConfig`` of fusion-pass flags.
    - ``inductor_options``: Inductor config patches, e.g. ``{"max_autotune": True}``.
    - ``cudagraph_mode``: ``"none"``, ``"piecewise"`` (each compiled piece a graph per
      capture size, splitting ops eager between), ``"full"`` (the whole forward a graph per
      capture size), ``"full_and_piecewise"`` (vLLM's FULL_AND_PIECEWISE: a call the caller
      marks as a decode batch, ``cachebuild.decoding()``, replays a full graph at the
      ``decode_sizes``, every other call of a capture size piecewise graphs) or
      ``"full_decode_only"`` (full graphs for marked decode calls, no graphs otherwise).
    - ``capture``: when sizes are captured: ``"eager"`` (all of them before the first
      call returns), ``"background"`` (a thread captures them after the first output),
      ``"lazy"`` (each at its first call), or ``"auto"`` (background on CUDA, lazy
      elsewhere). A size without graphs yet runs the compiled pieces directly, exactly.
    - ``capture_sizes``: sizes captured as CUDA graphs (default: 51 sizes up to 512).
    - ``decode_sizes``: the sizes (sequences of one token each) at which a marked decode
      call replays a full graph, in the two modes that have them; each must be a capture
      size. None (default): every capture size up to 256.
    - ``pad_to_capture_size``: run a call whose size was not captured at the next captured
      size, zero-padding the dynamic dim and cutting outputs back where their traced dims
      are the token count (token-parallel models); a model whose outputs depend on it
      otherwise (``2 * T`` rows) runs every call at its own size, said once. For models
      whose tokens mix only in attention: the first padded call also runs at its own
      size, and where the padding rows changed the other rows (a mean over tokens),
      calls run at their own size from then on, said once; made again at the first
      padded call after weights are written in place (``load_state_dict``; a write
      through ``.data`` leaves no trace it can see).
    - ``out_of_range``: a call whose size is outside every range raises (``"error"``)
      or runs the model eagerly with a one-time warning (``"eager"``).
    - ``on_failure``: a model that cannot be compiled (its trace, split or a build
      fails) raises (``"error"``), and raises again at once at every later call, with
      no new attempt; or runs eagerly from then on with one warning (``"eager"``).
    - ``while_building``: what a cold start whose targets are not all stored serves with
      until they are: nothing, it waits for them (``"wait"``); or targets of a backend that
      builds in seconds (``"eager_fusion"``, or the inductor backend's ``"standalone"``
      flavour), built first, while the missing targets build in worker processes; once all
      are stored, the next call swaps to them (no call mixes the two), and a process that
      ends first waits for them at its exit (Ctrl-C leaves them). ``"auto"`` (default):
      ``$CACHEBUILD_WHILE_BUILDING`` where set, else ``"standalone"`` for AOTInductor
      targets on a CPU (their C++ wrappers are most of a cold build there, and standalone
      pieces run the same kernels) and ``"wait"`` elsewhere, or where builds run in the
      calling process (``CACHEBUILD_BUILD_JOBS=1``). A model whose targets workers cannot
      build as its process would (custom passes or ops defined in ``__main__``) waits
      (with a warning where it asked for another); so do ``cachebuild warm`` and the
      torch.compile front door (``cachebuild.backend``).
    """

    splitting_ops: tuple[str, ...] = ()
    compile_ranges: tuple[tuple[int, int], ...] = ((1, 8192),)
    compile_sizes: tuple[int, ...] = ()
    backend: str = "inductor"
    flavour: str = "auto"
    passes: PassConfig = field(default_factory=PassConfig)
    inductor_options: tuple[tuple[str, Any], ...] = ()
    cudagraph_mode: str = "none"
    capture: str = "auto"
    capture_sizes: tuple[int, ...] = field(default_factory=default_capture_sizes)
    decode_sizes: tuple[int, ...] | None = None
    pad_to_capture_size: bool = False
    out_of_range: str = "error"
    on_failure: str = "error"
    while_building: str = "auto"

    def __post_init__(self) -> None:
        # Normalise containers so equal configs hash equal and are immutable; refuse any
        # value of the wrong type rather than coerce it (3.7 is not the size 3).
        set_ = object.__setattr__
        ops = self.splitting_ops
        if isinstance(ops, str):
            ops = (ops,)
        set_(self, "splitting_ops", _sequence(ops, "splitting_ops", "op names, e.g. "
                                              "('mylib::attention',)"))
        ranges = []
        pairs_given = _sequence(self.compile_ranges, "compile_ranges", "(lo, hi) pairs, e.g. "
                                "((1, 8192),)")
        if len(pairs_given) > MAX_RANGES:
            raise ConfigError(f"compile_ranges may list at most {MAX_RANGES} ranges, not "
                              f"{len(pairs_given)}")
        for pair in pairs_given:
            if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2 \
                    or not all(_is_whole(v) for v in pair):
                raise ConfigError(f"compile_ranges must hold (lo, hi) pairs of whole numbers, "
                                  f"e.g. ((1, 8192),); got {_show(pair)}")
            ranges.append((operator.index(pair[0]), operator.index(pair[1])))
        set_(self, "compile_ranges", tuple(ranges))
        for name, most in (("compile_sizes", MAX_COMPILE_SIZES),
                           ("capture_sizes", MAX_CAPTURE_SIZES)):
            values = _sequence(getattr(self, name), name, "whole numbers, e.g. (1, 8)")
            if len(values) > most:
                raise ConfigError(f"{name} may list at most {most} sizes, not {len(values)}")
            set_(self, name, tuple(sorted({_whole(v, f"each of {name}") for v in values})))
        if self.decode_sizes is not None:
            values = _sequence(self.decode_sizes, "decode_sizes", "whole numbers, e.g. (1, 8), "
                               "or None")
            set_(self, "decode_sizes",
                 tuple(sorted({_whole(v, "each of decode_sizes") for v in values})))
        opts = self.inductor_options
        if isinstance(opts, dict):
            opts = tuple(opts.items())
        pairs = _sequence(opts, "inductor_options", "a dict of Inductor config names and "
                          "values, e.g. {'max_autotune': True}")
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ConfigError(f"inductor_options must map Inductor config names to values, "
                                  f"e.g. {{'max_autotune': True}}; got {_show(pair)}")
            _check_value(pair[1], f"inductor_options[{pair[0]!r}]")
        set_(self, "inductor_options", tuple(sorted(((k, v) for k, v in pairs),
                                                   key=lambda kv: kv[0])))
        if not isinstance(self.pad_to_capture_size, bool):
            raise ConfigError(f"pad_to_capture_size must be True or False, got "
                              f"{_show(self.pad_to_capture_size)}")
        self._validate()
        if "torch._inductor.config" in sys.modules:  # free to check now (see module doc)
            check_inductor_options(self)

    def _validate(self) -> None:
        for op in self.splitting_ops:
            if not isinstance(op, str) or not OP_NAME.match(op):
                raise ConfigError(
                    f"splitting op {op!r} does not parse: write it as 'namespace::name' "
                    "or 'namespace::name.overload', e.g. 'aten::scaled_dot_product_attention'"
                )
        if not self.compile_ranges:
            raise ConfigError("compile_ranges is empty: give at least one (lo, hi) range")
        ranges = sorted(self.compile_ranges)
        for lo, hi in ranges:
            if lo < 1 or hi < lo:
                raise ConfigError(f"compile range ({lo}, {hi}) is empty or starts below 1")
            if hi > MAX_SIZE:
                raise ConfigError(f"compile range ({lo}, {hi}) ends past {MAX_SIZE}, the "
                                  "largest size a range may reach")
        for (_, hi1), (lo2, hi2) in zip(ranges, ranges[1:], strict=False):
            if lo2 <= hi1:
                raise ConfigError(f"compile ranges overlap: ({lo2}, {hi2}) starts at or before {hi1}")
        for size in self.compile_sizes:
            if not any(lo <= size <= hi for lo, hi in ranges):
                raise ConfigError(f"compile size {size} lies outside every compile range {ranges}")
        if not isinstance(self.passes, PassConfig):
            raise ConfigError(
                f"passes must be a cachebuild.passes.PassConfig, got {type(self.passes).__name__}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a backend's name, got {self.backend!r}")
        if self.flavour not in FLAVOURS:
            raise ConfigError(f"unknown flavour {self.flavour!r}: choose one of {FLAVOURS}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ConfigError(
                f"unknown cudagraph_mode {self.cudagraph_mode!r}: choose one of {CUDAGRAPH_MODES}"
            )
        if self.capture not in CAPTURE_POLICIES:
            raise ConfigError(
                f"unknown capture policy {self.capture!r}: choose one of {CAPTURE_POLICIES}")
        if self.out_of_range not in OUT_OF_RANGE:
            raise ConfigError(f"out_of_range must be one of {OUT_OF_RANGE}")
        if self.while_building not in WHILE_BUILDING:
            raise ConfigError(f"while_building must be one of {WHILE_BUILDING}, not "
                              f"{_show(self.while_building)}")
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"on_failure must be one of {ON_FAILURE}, not {_show(self.on_failure)}")
        if any(s < 1 for s in self.capture_sizes):
            raise ConfigError("capture sizes must be positive")
        stray = sorted(set(self.decode_sizes or ()) - set(self.capture_sizes))
        if stray:
            raise ConfigError(f"decode_sizes {stray} are not capture sizes: add them to "
                              "capture_sizes, or leave decode_sizes None (every capture size "
                              f"up to {DEFAULT_MAX_DECODE})")
        for name in ("compile_sizes", "capture_sizes"):
            largest = max(getattr(self, name), default=0)
            if largest > MAX_SIZE:
                raise ConfigError(f"{name} holds {largest}: sizes go from 1 to {MAX_SIZE}")

    def full_decode_sizes(self) -> tuple[int, ...]:
        """The sizes at which a marked decode call replays a full graph (``decode_sizes``,
        or every capture size up to ``DEFAULT_MAX_DECODE``); empty in modes without full
        decode graphs."""
        if self.cudagraph_mode not in ("full_and_piecewise", "full_decode_only"):
            return ()
        if self.decode_sizes is not None:
            return self.decode_sizes
        return tuple(s for s in self.capture_sizes if s <= DEFAULT_MAX_DECODE)

    def inductor_options_dict(self) -> dict[str, Any]:
        return dict(self.inductor_options)

    def in_buckets(self, size: int) -> bool:
        """Whether a shape bucket holds ``size`` (a range does: exact sizes lie in one)."""
        return any(lo <= size <= hi for lo, hi in self.compile_ranges)

    def outside(self, size: int) -> str | None:
        """What a call whose dynamic dim is ``size`` is told: None where a bucket holds it;
        where none does, the warning it runs eagerly with (``out_of_range="eager"``), or
        else the error it raises."""
        if self.in_buckets(size):
            return None
        if self.out_of_range == "eager":
            return f"size {size} is outside every compile range; running eagerly"
        return (f"size {size} of the dynamic dim is outside every compile range "
                f"{list(self.compile_ranges)}; add a range or set out_of_range='eager'")

    def buckets(self) -> list[dict[str, Any]]:
        """Every shape bucket: exact sizes first, then ranges (the dispatch order)."""
        return [{"size": s} for s in self.compile_sizes] + [
            {"range": [lo, hi]} for lo, hi in sorted(self.compile_ranges)
        ]

    def interim(self, device: str, *, setting: str | None = None,
                builds_here: bool = False) -> CompileConfig | None:
        """The config of the targets a cold start on ``device`` serves with while this
        config's build (``while_building``), or None where there are none to serve with
        (``wait``, or the same backend anyway). ``auto`` means ``setting`` (the operator's
        ``$CACHEBUILD_WHILE_BUILDING``, read by the caller) where given, else standalone
        pieces where AOTInductor packages would build for a CPU in workers (their C++
        wrappers are most of a cold build there; a standalone piece runs the same kernels
        with a Python wrapper), and ``wait`` on a GPU (a swap would capture every size's
        graphs twice, and a package's wrapper is a small part of its build) or where
        builds run in the calling process (``builds_here``)."""
        choice = self.while_building
        if choice == "auto":
            choice = setting or (
                "standalone" if self.backend == "inductor" and self.flavour != "standalone"
                and device.split(":")[0] == "cpu" and not builds_here else "wait")
        if choice == "wait" or self.backend == "eager_fusion":  # nothing builds faster
            return None
        if choice == "eager_fusion":
            return replace(self, backend="eager_fusion", while_building="wait")
        if self.backend == "inductor" and self.flavour == "standalone":
            return None
        return replace(self, backend="inductor", flavour="standalone", while_building="wait")

    def factors(self) -> dict[str, Any]:
        """The config as key factors (used by the entry key).

        Run-time policies (graph mode, capture sizes, padding, out-of-range handling) are
        left out: they change nothing that is stored, so one warmed entry serves them all.
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in RUNTIME_ONLY:
                continue
            value = getattr(self, f.name)
            if f.name == "passes":
                value = value.factors()
            elif f.name == "inductor_options":
                value = {k: _plain(v) for k, v in value}
            out[f.name] = value
        return out


def _check_value(value: Any, what: str, depth: int = 0) -> None:
    """ConfigError for a NaN or infinite float anywhere in an option's value (and for
    values nested past reason)."""
    if depth > 32:
        raise ConfigError(f"{what} is nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for v in value.values():
            _check_value(v, what, depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in value:
            _check_value(v, what, depth + 1)


def check_inductor_options(config: CompileConfig) -> None:
    """ConfigError if ``config.inductor_options`` names a setting that Inductor's config
    does not have (imports ``torch._inductor.config``: seconds, once per process). Run
    before a trace or a build, and at once by CompileConfig where it is loaded already.

    Also a ConfigError where Inductor's freezing is asked for (``TORCHINDUCTOR_FREEZING=1``,
    ``torch._inductor.config.freezing``, or these options): it makes the weights constants
    of the compiled code, which cachebuild binds to the live model's weights instead."""
    inductor = sys.modules.get("torch._inductor.config")
    if dict(config.inductor_options).get("freezing") or \
            os.environ.get("TORCHINDUCTOR_FREEZING") == "1" or \
            (inductor is not None and getattr(inductor, "freezing", False)):
        raise ConfigError("Inductor's freezing is on (TORCHINDUCTOR_FREEZING=1, "
                          "torch._inductor.config.freezing or inductor_options): it makes "
                          "the weights constants of the compiled code, and cachebuild's "
                          "pieces read the live model's weights instead; turn it off")
    if not config.inductor_options:
        return
    known = _inductor_settings()
    for name, _ in config.inductor_options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"inductor_options: Inductor has no setting {name!r}{hint} "
                              "(the names of torch._inductor.config, e.g. 'max_autotune', "
                              "'cpp.cxx')")


@functools.cache
def _inductor_settings() -> frozenset[str]:
    import torch._inductor.config as inductor_config

    return frozenset(inductor_config.get_config_copy())


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _is_whole(value: Any) -> bool:
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _whole(value: Any, what: str) -> int:
    """``value`` if it is a whole number (an int, not a bool, a float or a string)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a whole number, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be a whole number, got {_show(value)}") from None


def _sequence(value: Any, name: str, expected: str) -> tuple[Any, ...]:
    """``value`` as a tuple if it is a sequence or set (not a string), else ConfigError."""
    if isinstance(value, str | bytes | dict) or not isinstance(value, Sequence | Set):
        raise ConfigError(f"{name} must be {expected}; got {_show(value)}")
    return tuple(value)


def check_config(config: Any) -> CompileConfig:
    """``config`` if it is a CompileConfig (None: the default one), else ConfigError."""
    if config is None:
        return CompileConfig()
    if not isinstance(config, CompileConfig):
        raise ConfigError(f"config must be a cachebuild.CompileConfig, not {_show(config)} "
                          "(e.g. CompileConfig(splitting_ops=('mylib::attention',)))")
    return config


def check_dynamic_dims(dynamic_dims: Any) -> dict[int, int]:
    """``dynamic_dims`` as a dict of argument index → dim (both whole numbers, 0 or
    more), else ConfigError. None is no dynamic dims."""
    if dynamic_dims is None:
        return {}
    if not isinstance(dynamic_dims, Mapping):
        raise ConfigError(f"dynamic_dims must map an argument's index to its dynamic dim, "
                          f"e.g. {{0: 0, 1: 0}}; got {_show(dynamic_dims)}")
    out = {}
    for arg, dim in dynamic_dims.items():
        i, d = _whole(arg, "a dynamic_dims argument index"), _whole(dim, "a dynamic dim")
        if i < 0 or d < 0:
            raise ConfigError(f"dynamic_dims {{{i}: {d}}}: indices and dims count from 0")
        out[i] = d
    return out


def _plain(value: Any) -> Any:
    """Option values as JSON-able factors (repr for anything exotic)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)
