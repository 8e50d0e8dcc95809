"""Which operators, tensor methods and tensor attributes are pure tensor computation.

A stored graph is data, so what it may call must not reach outside tensors: no file,
path, storage, network, process or global state. This module decides that from each
operator's schema, the way the dispatcher declares it, rather than from a list of names:

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

Tensor methods (``x.view(...)``) are judged by the operator of their name; a method with
no operator of its name is allowed only if it converts a tensor's dtype or device (its
name is a dtype or a device type) or is one of the few plain reads and conversions in
``METHODS_WITHOUT_OP``. ``getattr`` is allowed only as a read of a tensor's public data
attribute (Dynamo records ``w.T`` as ``getattr(w, 'T')``); no other value a graph holds
(numbers, tuples, dtypes) has an attribute of those names that does more than read.

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

#: Schema type kinds that are capabilities rather than data (see the module doc).
_CAPABILITY_KINDS = frozenset({
    "StorageType", "StreamObjType", "ClassType", "FutureType", "RRefType", "AwaitType",
    "CapsuleType", "PyObjectType", "AnyClassType", "InterfaceType", "FunctionType",
    "QuantizerType"})
#: Words in a ``str`` argument's name that make it a location.
_LOCATION_WORDS = ("file", "path", "dir", "url", "uri", "host", "socket", "command", "cmd")

#: Tensor methods without an operator of their own name that only read a tensor or convert
#: it (``x.byte()``, ``x.tolist()``, ``x.new_tensor(data)``).
METHODS_WITHOUT_OP = frozenset({
    "byte", "char", "type", "new", "new_tensor", "tolist", "unique", "ndimension",
    "nelement", "dim_order", "to_sparse_coo", "data_ptr", "const_data_ptr", "is_shared"})
#: Tensor data attributes that hand out autograd's graph (hooks can be set on it).
_GRAPH_ATTRIBUTES = frozenset({"grad_fn"})

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


def op_impurity(op: Any) -> str | None:
    """``operator_impurity`` of an ``OpOverload`` (its own schema) or ``OpOverloadPacket``
    (every overload)."""
    if isinstance(op, torch._ops.OpOverload):
        why = schema_impurity(op._schema)
        return None if why is None else f"{op.name()}: {why}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return operator_impurity(op._qualified_op_name)
    return f"{op!r} is not an operator"


def binding_impurity(name: str) -> str | None:
    """For a function of torch's C modules that binds the ATen operator of its name
    (``torch.cat``, ``torch._C._nn.linear``): why that operator is not pure. A function
    with no operator of its name (``torch.frombuffer``, ``torch._from_blob``) is refused."""
    return operator_impurity(f"aten::{name}")


def _is_dtype_name(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def _is_device_type(name: str) -> bool:
    try:
        return torch.device(name).index is None
    except (RuntimeError, ValueError, TypeError):
        return False


@functools.cache
def method_impurity(name: str) -> str | None:
    """Why the public ``torch.Tensor`` method ``name`` is not pure tensor computation
    (None if it is): judged by the ATen operator of its name (an in-place method by its
    own), else allowed only as a dtype or device conversion or one of
    ``METHODS_WITHOUT_OP``."""
    if torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        return operator_impurity(f"aten::{name}")
    if _is_dtype_name(name) or _is_device_type(name) or name in METHODS_WITHOUT_OP:
        return None
    return f"Tensor.{name} computes with no operator whose schema says what it does"


@functools.cache
def tensor_attributes() -> frozenset[str]:
    """The attributes ``getattr`` may read in a stored graph: ``torch.Tensor``'s public
    data attributes (``T``, ``mT``, ``shape``, ``dtype``, ``real``, ...), not methods, and
    not the autograd graph."""
    return frozenset(
        name for name in dir(torch.Tensor)
        if not name.startswith("_") and name not in _GRAPH_ATTRIBUTES
        and not callable(getattr(torch.Tensor, name, None)))


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


def _check_combinatorial(n: Any, *rest: Any) -> None:
    if isinstance(n, int) and n > 4096:
        raise _limit(f"a combinatorial function of {n}")


_CHECKS: dict[Any, Callable[..., None]] = {
    operator.mul: _check_mul, operator.imul: _check_mul,
    operator.add: _check_add, operator.iadd: _check_add,
    operator.concat: _check_add, operator.iconcat: _check_add,
    operator.pow: _check_pow, operator.ipow: _check_pow, builtins.pow: _check_pow,
    operator.lshift: _check_shift, operator.ilshift: _check_shift,
    math.factorial: _check_combinatorial, math.comb: _check_combinatorial,
    math.perm: _check_combinatorial,
}
_BOUNDED: dict[int, Callable[..., Any]] = {}
_ORIGINAL: dict[int, Callable[..., Any]] = {}


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What a loaded graph calls for ``fn``: ``fn`` itself, or for Python arithmetic that
    can grow without bound a version that refuses (Impure) operands past ``MAX_INT_BITS``
    or ``MAX_ITEMS`` before computing."""
    check = _CHECKS.get(fn)
    if check is None:
        return fn
    found = _BOUNDED.get(id(fn))
    if found is None:
        def call(*args: Any) -> Any:
            check(*args)
            return fn(*args)

        call.__name__ = call.__qualname__ = f"bounded_{fn.__name__}"
        found = _BOUNDED[id(fn)] = call
        _ORIGINAL[id(call)] = fn
    return found


def original(fn: Any) -> Any:
    """The function a ``bounded`` stand-in stands for (anything else as it is), so that a
    loaded graph is stored, keyed and compiled under the names it was loaded from."""
    return _ORIGINAL.get(id(fn), fn)
