"""Which library operators are pure tensor computation, and bounded Python arithmetic.

What a stored graph may name is decided by the closed table of ``cachebuild.trust.allowed``.
Operators outside torch's namespaces and this project's (a library's splitting op, a
model's custom op) are not in that table: they are judged here from their schemas, the
way the dispatcher declares them, and so is every operator the table admits (twice
checked). A stored graph must not reach outside tensors: no file, path, storage,
network, process or global state:

- **Types.** No argument or result is a capability: a ``Storage`` (raw memory), a
  ``Stream``, a script class (``torch.classes``: process groups, packed parameters,
  profiler records), a ``Future``, ``RRef``, ``Await``, capsule or Python object. A
  result may not be a ``Generator`` either. So a stored graph can neither make such an
  object nor hand one to an operator.
- **Effects.** An operator either returns something or writes an argument it is given
  (``Tensor(a!)``, e.g. ``index_copy_`` into a KV cache). One that does neither exists for
  an effect outside the graph's data (``aten::save``, ``aten::_print``,
  ``aten::manual_seed``, ``aten::set_grad_enabled``, barriers, asserts) and is refused.
- **Strings.** A ``str`` argument may choose how tensors are computed (a rounding mode,
  an einsum equation, a reduction), never where data comes from or goes: an operator
  that makes a tensor from a string without taking a tensor (``aten::from_file``,
  ``debugprims::load_tensor``) is refused, and so is any ``str`` argument whose name
  says it is a location (``filename``, ``path``, ``dir``, ``url``, ...).

An operator packet (``aten::add`` without an overload) may dispatch to any of its
overloads, so all of them must pass. A library's own operators are judged by the schema
it registered: the check cannot see through a kernel that does more than its schema says.

Python arithmetic can be made to run for hours (``2 ** 2 ** 40``) or fill memory
(``[0] * 2 ** 40``): ``bounded`` gives the versions of such functions that a graph run as
Python calls, which refuse operands past ``MAX_INT_BITS`` and ``MAX_ITEMS``.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from cachebuild.errors import CachebuildError
from cachebuild.trust import allowed

#: Schema type kinds that are capabilities rather than data (see the module doc).
_CAPABILITY_KINDS = frozenset({
    "StorageType", "StreamObjType", "ClassType", "FutureType", "RRefType", "AwaitType",
    "CapsuleType", "PyObjectType", "AnyClassType", "InterfaceType", "FunctionType",
    "QuantizerType"})
#: Words in a ``str`` argument's name that make it a location.
_LOCATION_WORDS = ("file", "path", "dir", "url", "uri", "host", "socket", "command", "cmd")

#: The largest Python integer (in bits) and sequence (in items) a loaded graph's
#: arithmetic may produce: shapes and indices are far below both.
MAX_INT_BITS = 1 << 16
MAX_ITEMS = 1 << 20


class Impure(CachebuildError, ValueError):
    """What a stored graph may not call or compute, and why."""


def _type_impurity(t: Any, *, result: bool) -> str | None:
    """Why a schema type is not data (None if it is)."""
    kind = t.kind()
    if kind in _CAPABILITY_KINDS or (result and kind == "GeneratorType"):
        return f"a {t} {'result' if result else 'argument'}"
    if kind in ("OptionalType", "ListType"):
        return _type_impurity(t.getElementType(), result=result)
    if kind == "TupleType":
        for inner in t.elements():
            if (why := _type_impurity(inner, result=result)) is not None:
                return why
    if kind == "DictType":
        for inner in (t.getKeyType(), t.getValueType()):
            if (why := _type_impurity(inner, result=result)) is not None:
                return why
    return None


def _contains_kind(t: Any, kinds: tuple[str, ...]) -> bool:
    kind = t.kind()
    if kind in kinds:
        return True
    if kind in ("OptionalType", "ListType"):
        return _contains_kind(t.getElementType(), kinds)
    if kind == "TupleType":
        return any(_contains_kind(inner, kinds) for inner in t.elements())
    return False


def schema_impurity(schema: Any) -> str | None:
    """Why the operator ``schema`` (a ``torch._C.FunctionSchema``) is not pure tensor
    computation, or None if it is (see the module doc for the three rules)."""
    for arg in schema.arguments:
        if (why := _type_impurity(arg.real_type, result=False)) is not None:
            return f"it takes {why} ({arg.name})"
    for ret in schema.returns:
        if (why := _type_impurity(ret.real_type, result=True)) is not None:
            return f"it returns {why}"
    writes = any(arg.alias_info is not None and arg.alias_info.is_write
                 for arg in schema.arguments)
    if not schema.returns and not writes:
        return "it returns nothing and writes none of its arguments: it exists for another effect"
    strings = [a for a in schema.arguments if _contains_kind(a.real_type, ("StringType",))]
    for arg in strings:
        if any(word in arg.name.lower() for word in _LOCATION_WORDS):
            return f"its string argument {arg.name!r} names a location"
    takes_tensor = any(_contains_kind(a.real_type, ("TensorType",)) for a in schema.arguments)
    makes_tensor = any(_contains_kind(r.real_type, ("TensorType",)) for r in schema.returns)
    if strings and makes_tensor and not takes_tensor:
        return "it makes a tensor from a string without taking one"
    return None


def _schema_name(schema: Any) -> str:
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


@functools.cache
def operator_impurity(qualified: str) -> str | None:
    """Why the operator named ``qualified`` (``ns::name`` for every overload, or
    ``ns::name.overload`` for one) is not pure, or None if it is. An unknown name is
    impure."""
    name, _, overload = qualified.partition(".")
    schemas = torch._C._jit_get_schemas_for_operator(name)
    if overload:
        schemas = [s for s in schemas if s.overload_name == overload
                   or (overload == "default" and not s.overload_name)]
    if not schemas:
        return f"{qualified} is not a registered operator"
    for schema in schemas:
        if (why := schema_impurity(schema)) is not None:
            return f"{_schema_name(schema)}: {why}"
    return None


def _overloads_impurity(qualified: str, overloads: tuple[str, ...]) -> str | None:
    if not overloads:
        return f"{qualified} is not a registered operator"
    for overload in overloads:
        if (why := operator_impurity(f"{qualified}.{overload}")) is not None:
            return why
    return None


def op_impurity(op: Any) -> str | None:
    """``operator_impurity`` of an ``OpOverload`` (its own schema) or ``OpOverloadPacket``
    (every overload a call of it can reach: ``allowed.packet_overloads``)."""
    if isinstance(op, torch._ops.OpOverload):
        why = schema_impurity(op._schema)
        return None if why is None else f"{op.name()}: {why}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        qualified = op._qualified_op_name
        return _overloads_impurity(qualified, allowed.packet_overloads(qualified))
    return f"{op!r} is not an operator"


def binding_impurity(name: str) -> str | None:
    """For a function of torch's C modules that binds the ATen operator of its name
    (``torch.cat``, ``torch._C._nn.linear``): why an overload it can reach
    (``allowed.reachable``, as the table judges it) is not pure. A function with no
    operator of its name (``torch.frombuffer``, ``torch._from_blob``) is refused."""
    return _overloads_impurity(f"aten::{name}", allowed.reachable(name))


# -- bounded arithmetic ------------------------------------------------------------------

def _bits(value: Any) -> int:
    return value.bit_length() if isinstance(value, int) else 0


def _items(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _limit(what: str) -> Impure:
    return Impure(f"a stored graph's arithmetic went past its bounds ({what})")


def _check_mul(a: Any, b: Any) -> None:
    for seq, n in ((a, b), (b, a)):
        size = _items(seq)
        if size is not None and isinstance(n, int) and size * max(n, 0) > MAX_ITEMS:
            raise _limit(f"a sequence of {size} items repeated {n} times")
    if _bits(a) + _bits(b) > MAX_INT_BITS:
        raise _limit("a product of more than 2**16 bits")


def _check_add(a: Any, b: Any) -> None:
    size_a, size_b = _items(a), _items(b)
    if size_a is not None and size_b is not None and size_a + size_b > MAX_ITEMS:
        raise _limit(f"joining sequences of {size_a} and {size_b} items")


def _check_pow(a: Any, b: Any, *mod: Any) -> None:
    if isinstance(a, int) and isinstance(b, int) and not mod and abs(a) > 1 \
            and _bits(a) * b > MAX_INT_BITS:
        raise _limit(f"{a.bit_length()}-bit number to the power {b}")


def _check_shift(a: Any, b: Any) -> None:
    if isinstance(a, int) and isinstance(b, int) and _bits(a) + b > MAX_INT_BITS:
        raise _limit(f"a shift by {b} bits")


def _check_pow3(a: Any, b: Any, *mod: Any) -> None:
    # Modular exponentiation costs bits(b) multiplications of bits(mod)-bit numbers.
    if mod and isinstance(b, int) and _bits(b) + max(_bits(a), _bits(mod[0])) > MAX_INT_BITS // 4:
        raise _limit(f"a modular power of {_bits(b)} and {_bits(mod[0])} bits")
    _check_pow(a, b, *mod)


def _check_product(values: Any = (), *rest: Any, **kwargs: Any) -> None:
    # math.prod's result, and math.lcm's, has up to the sum of its operands' bits.
    items = [*values] if isinstance(values, list | tuple) else [values, *rest]
    if len(items) > MAX_ITEMS:
        raise _limit(f"a product of {len(items)} numbers")
    if sum(_bits(v) for v in items) + _bits(kwargs.get("start", 1)) > MAX_INT_BITS:
        raise _limit("a product of more than 2**16 bits")


def _check_lcm(*values: Any) -> None:
    _check_product(values)


def _check_round(number: Any, ndigits: Any = None) -> None:
    # round(n, -k) computes 10**k.
    if isinstance(ndigits, int) and abs(ndigits) > 4096:
        raise _limit(f"rounding to {ndigits} digits")


def _check_int(value: Any = 0, *base: Any) -> None:
    # int("f" * 10**7, 16) is not limited by Python's digit limit (powers of two are not).
    if isinstance(value, str | bytes | bytearray) and len(value) > 4096:
        raise _limit(f"a number of {len(value)} characters")


def _check_mod(a: Any, b: Any) -> None:
    # "%0*d" % (2**30, 1) allocates a gigabyte: no string formatting in a stored graph.
    if isinstance(a, str | bytes | bytearray):
        raise _limit("string formatting")


_CHECKS: dict[Any, Callable[..., None]] = {
    operator.mul: _check_mul, operator.imul: _check_mul,
    operator.add: _check_add, operator.iadd: _check_add,
    operator.concat: _check_add, operator.iconcat: _check_add,
    operator.pow: _check_pow, operator.ipow: _check_pow, builtins.pow: _check_pow3,
    operator.lshift: _check_shift, operator.ilshift: _check_shift,
    operator.mod: _check_mod, operator.imod: _check_mod,
    math.prod: _check_product, math.lcm: _check_lcm,
    builtins.round: _check_round, builtins.int: _check_int,
}
_BOUNDED: dict[int, Callable[..., Any]] = {}


def _no_check(*args: Any, **kwargs: Any) -> None:
    pass
_ORIGINAL: dict[int, Callable[..., Any]] = {}


@functools.cache
def _uninitialized() -> frozenset[Any]:
    """The callables that return uninitialised memory (``allowed.UNINITIALIZED``, and
    torch's bindings of them)."""
    ops = [getattr(getattr(torch.ops.aten, row.split(".")[0]), row.split(".")[1])
           for row in allowed.UNINITIALIZED]
    return frozenset([*ops, torch.empty, torch.empty_like, torch.empty_strided])


def _zeroed(_: Any, result: Any) -> Any:
    if torch.are_deterministic_algorithms_enabled() and \
            torch.utils.deterministic.fill_uninitialized_memory:  # type: ignore[attr-defined]
        return result  # torch filled it already (NaN, or an integer's largest), as eager does
    with torch.no_grad():
        return result.zero_()


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What a loaded graph calls for ``fn``: ``fn`` itself; for Python arithmetic that
    can grow without bound a version that refuses (Impure) operands past ``MAX_INT_BITS``
    or ``MAX_ITEMS`` before computing; for an operator that returns uninitialised memory
    (``torch.empty``) a version that zero-fills it, so that a graph never reads what a
    freed tensor held (unless deterministic algorithms have torch fill it)."""
    try:
        zero = fn in _uninitialized()
    except TypeError:  # unhashable
        zero = False
    check = _CHECKS.get(fn) if not zero else _no_check
    if check is None:
        return fn
    found = _BOUNDED.get(id(fn))
    if found is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            result = fn(*args, **kwargs)
            return _zeroed(fn, result) if zero else result

        name = getattr(fn, "__name__", "op")
        call.__name__ = call.__qualname__ = f"bounded_{name}"
        found = _BOUNDED[id(fn)] = call
        _ORIGINAL[id(call)] = fn
    return found


def original(fn: Any) -> Any:
    """The function a ``bounded`` stand-in stands for (anything else as it is), so that a
    loaded graph is stored, keyed and compiled under the names it was loaded from."""
    return _ORIGINAL.get(id(fn), fn)
