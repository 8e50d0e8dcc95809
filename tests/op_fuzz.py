"""The driver of ``test_trust_fuzz_ops.py``: every operator and function a stored graph
could name that takes sizes, strides, offsets, storages or raw integers, tried the way
an attacker would, in child processes.

``python op_fuzz.py plan SEED`` (a child) enumerates the pool from torch's operator
registry (``torch._C._dispatch_get_all_op_names()`` and each overload's schema), not by
hand: every ATen overload with an argument of type ``int``/``SymInt`` (or a list or
optional of one) or ``Storage``. Each must either be refused by the loader
(``fxjson.data_to_module`` of a one-node graph naming it: a "refusal missing" otherwise)
or be admitted by the table, and then it is run. Likewise every public function of
``math``, ``operator`` and ``builtins`` and every public tensor method: refused, or
admitted and run. It prints the jobs to run as JSON lines.

``python op_fuzz.py run JOBS.jsonl FIRST`` (a child, memory limited) runs jobs from
``FIRST`` on, printing ``start N`` before each: an admitted operator through the loader,
on inputs allocated between canary tensors, with adversarial integers
(2**33, 2**40, -2**40, 3415, -1, ...) for every integer argument; a Python function
through its bounded version with huge numbers, long lists and strings. After each job the
canaries must be unchanged (nothing written outside the inputs) and no result may hold
the canary's value (nothing read outside them); each job has ``JOB_SECONDS``.

The test runs ``run`` again after the job that killed a child (a crash) or hung it, so a
run reports every failure: "crash", "hang", "canary-written", "canary-read",
"refusal-missing". An operator raising an error is fine: that is its check working.
"""

from __future__ import annotations

import builtins
import json
import math
import operator
import random
import resource
import signal
import sys
from typing import Any

JOB_SECONDS = 5
#: Integers an attacker puts where a size, stride, offset, index or address goes.
EVIL_INTS = (1 << 33, 1 << 40, -(1 << 40), 5000, 8192, -1, 1 << 62, 7, -3)
SENTINEL = -7777.0
INDEX_SENTINEL = 777_777_777
#: Memory a run child may map: enough for torch, too little for a huge allocation to
#: succeed and then be filled.
MEMORY_LIMIT = 4 << 30


def _int_like(t: Any) -> bool:
    kind = t.kind()
    if kind in ("IntType", "SymIntType", "StorageType"):
        return True
    if kind in ("OptionalType", "ListType"):
        return _int_like(t.getElementType())
    return False


def pool_operators() -> list[str]:
    """Every ATen overload (``name.overload``) that takes an integer or a storage."""
    import torch

    found = []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[6:].partition(".")
        try:
            packet = getattr(torch.ops.aten, name)
            schema = getattr(packet, overload or "default")._schema
        except (AttributeError, RuntimeError):
            continue
        if any(_int_like(a.real_type) for a in schema.arguments):
            found.append(f"{name}.{overload or 'default'}")
    return found


def _one_node(op: str, target: str, args: list, kwargs: dict | None = None) -> list[dict]:
    return [
        {"name": "x", "op": "placeholder", "target": "x", "args": {"t": []}, "kwargs": {"d": []}},
        {"name": "y", "op": op, "target": target, "args": {"t": args},
         "kwargs": {"d": [[k, v] for k, v in (kwargs or {}).items()]}},
        {"name": "output", "op": "output", "target": "output", "args": {"t": [{"n": "y"}]},
         "kwargs": {"d": []}},
    ]


def _refused(nodes: list[dict]) -> bool:
    """True if the loader refuses what the graph's one node names (whatever its args)."""
    from cachebuild.trust.fxjson import GraphFormatError, check_call, resolve_target

    node = nodes[1]
    try:
        target = node["target"]
        if node["op"] == "call_function":
            target = resolve_target(target)
        check_call(node["op"], target, (), {})
    except GraphFormatError:
        return True
    return False


def plan(seed: int) -> None:
    """Print the jobs (JSON lines), and a "refusal-missing" failure for anything admitted
    that the table does not list."""
    import torch

    from cachebuild.trust import allowed

    rng = random.Random(seed)
    for op in pool_operators():
        admitted = _refused(_one_node("call_function", f"op:aten::{op}", [{"n": "x"}])) is False
        if admitted != (op in allowed.ATEN):
            print(json.dumps({"failure": "refusal-missing", "what": f"aten::{op}",
                              "detail": "the loader and the table disagree"}))
        if admitted:
            for variant in range(4):
                print(json.dumps({"job": "op", "op": op, "seed": rng.randrange(1 << 30),
                                  "variant": variant}))
    modules = {"math": math, "operator": operator, "builtins": builtins}
    for module_name, module in modules.items():
        for name in sorted(dir(module)):
            if name.startswith("_") or not callable(getattr(module, name)):
                continue
            target = f"fn:{module_name}:{name}"
            if not _refused(_one_node("call_function", target, [{"n": "x"}])):
                print(json.dumps({"job": "fn", "target": target, "seed": rng.randrange(1 << 30)}))
    for name in sorted(dir(torch.Tensor)):
        if name.startswith("_") or not callable(getattr(torch.Tensor, name, None)):
            continue
        from cachebuild.trust.allowed import METHODS, method_refusal

        admitted = not _refused(_one_node("call_method", name, [{"n": "x"}]))
        if admitted and method_refusal(name) is not None:
            print(json.dumps({"failure": "refusal-missing", "what": f"Tensor.{name}",
                              "detail": "the loader admits a method the table refuses"}))
        if admitted and name not in METHODS and not allowed.dispatcher_overloads(f"aten::{name}"):
            print(json.dumps({"failure": "refusal-missing", "what": f"Tensor.{name}",
                              "detail": "admitted with no row"}))


# -- running ---------------------------------------------------------------------------------

class Inputs:
    """Input tensors, each with its own storage, allocated between canary tensors (which
    the allocator puts next to them): what a kernel reads or writes past an input's
    storage lands in a canary."""

    def __init__(self) -> None:
        import torch

        self.canaries: list[tuple[Any, Any]] = []
        # Inputs and canaries of one size (16 KiB), so that the allocator places them
        # side by side.
        self.x = self._between(torch.float32, (64, 64), 1.5)
        self.idx = self._between(torch.int64, (2048,), 1)
        self.mask = self._between(torch.bool, (128, 128), True)

    def _between(self, dtype: Any, shape: tuple[int, ...], fill: Any) -> Any:
        import torch

        sentinel = SENTINEL if dtype.is_floating_point else (
            INDEX_SENTINEL if dtype != torch.bool else False)
        n = (16 << 10) // dtype.itemsize
        before = torch.full((n,), sentinel, dtype=dtype)
        view = torch.full(shape, fill, dtype=dtype)
        after = torch.full((n,), sentinel, dtype=dtype)
        self.canaries += [(before, sentinel), (after, sentinel)]
        return view

    def canary_written(self) -> bool:
        return any(not bool((c == sentinel).all()) for c, sentinel in self.canaries)


def _holds_sentinel(value: Any, depth: int = 0) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_complex() or value.dtype == torch.bool:
            return False
        if value.numel() > (1 << 24):
            # Too large to compare (a broadcast view): read its first and last elements,
            # the ends of the memory it spans (a crash if that is not memory it owns).
            ends = [value[(0,) * value.dim()], value[(-1,) * value.dim()]]
            return any(float(e) in (SENTINEL, INDEX_SENTINEL) for e in ends)
        return bool((value == SENTINEL).any()) or bool((value == INDEX_SENTINEL).any())
    if isinstance(value, list | tuple) and depth < 3:
        return any(_holds_sentinel(v, depth + 1) for v in value)
    return False


def _arg_for(t: Any, rng: random.Random, inputs: Inputs) -> Any:
    """A value of schema type ``t``: inputs for tensors, adversarial integers for ints."""
    kind = t.kind()
    if kind == "OptionalType":
        return None if rng.random() < 0.3 else _arg_for(t.getElementType(), rng, inputs)
    if kind == "TensorType":
        return rng.choice([inputs.x, inputs.x, inputs.idx, inputs.mask])
    if kind in ("IntType", "SymIntType"):
        return rng.choice(EVIL_INTS)
    if kind == "ListType":
        inner = t.getElementType()
        return [_arg_for(inner, rng, inputs) for _ in range(rng.randrange(1, 4))]
    if kind == "FloatType":
        return 1.0
    if kind == "BoolType":
        return rng.random() < 0.5
    if kind in ("NumberType", "ScalarType"):
        return rng.choice([1.0, 2, rng.choice(EVIL_INTS)])
    raise LookupError(kind)  # a type this driver does not make: the job is skipped


def run_op(job: dict, inputs: Inputs) -> Any:
    import torch

    from cachebuild.trust.fxjson import data_to_module

    name, overload = job["op"].split(".", 1)
    schema = getattr(getattr(torch.ops.aten, name), overload)._schema
    rng = random.Random(job["seed"])
    args, kwargs = [], {}
    for arg in schema.arguments:
        if arg.has_default_value() and not _int_like(arg.real_type) and rng.random() < 0.7:
            continue
        try:
            value = _arg_for(arg.real_type, rng, inputs)
        except LookupError:
            if arg.has_default_value():
                continue
            return "skipped"
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    # Through the loader, as a stored graph would: tensors are the graph's inputs.
    tensors = []

    def encode(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"n": f"t{len(tensors) - 1}"}
        if isinstance(v, list):
            return [encode(x) for x in v]
        return v

    enc_args, enc_kwargs = [encode(a) for a in args], {k: encode(v) for k, v in kwargs.items()}
    nodes = [{"name": f"t{i}", "op": "placeholder", "target": f"t{i}", "args": {"t": []},
              "kwargs": {"d": []}} for i in range(len(tensors))]
    nodes += _one_node("call_function", f"op:aten::{job['op']}", enc_args, enc_kwargs)[1:]
    module = data_to_module(nodes)
    return module(*tensors)


#: Values for Python functions: huge numbers, long sequences, strings, format strings.
def _py_values() -> list[Any]:
    return [(1 << 65535) - 1, 1 << 62, -(1 << 62), 3, -1, 0, 2.5, 1e308, [0] * 1000,
            list(range(1 << 12)), "x" * 5000, "%0*d", (1 << 20, 1), (1,) * 1000, 10 ** 4000]


def run_fn(job: dict) -> Any:
    from cachebuild.trust.fxjson import resolve_target

    fn = resolve_target(job["target"])
    rng = random.Random(job["seed"])
    values = _py_values()
    for _ in range(60):
        args = [rng.choice(values) for _ in range(rng.randrange(1, 4))]
        try:
            fn(*args)
        except (Exception, MemoryError):
            pass
    return None


def run(jobs_path: str, first: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import torch

    torch.set_num_threads(1)
    jobs = [json.loads(line) for line in open(jobs_path)]
    signal.signal(signal.SIGALRM, _hang)
    for n in range(first, len(jobs)):
        job = jobs[n]
        print(f"start {n}", flush=True)
        inputs = Inputs()
        result: Any = None
        signal.alarm(JOB_SECONDS)
        try:
            result = run_op(job, inputs) if job["job"] == "op" else run_fn(job)
        except Hang:
            print(json.dumps({"failure": "hang", "job": n, "detail": json.dumps(job)}),
                  flush=True)
            continue
        except (Exception, MemoryError):
            result = None
        finally:
            signal.alarm(0)
        if inputs.canary_written():
            print(json.dumps({"failure": "canary-written", "job": n, "detail": json.dumps(job)}),
                  flush=True)
        elif _holds_sentinel(result):
            print(json.dumps({"failure": "canary-read", "job": n, "detail": json.dumps(job)}),
                  flush=True)
    print("done", flush=True)


class Hang(BaseException):
    pass


def _hang(*_: Any) -> None:
    raise Hang()


if __name__ == "__main__":
    if sys.argv[1] == "plan":
        plan(int(sys.argv[2]))
    else:
        run(sys.argv[2], int(sys.argv[3]))
