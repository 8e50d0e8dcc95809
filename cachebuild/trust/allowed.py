"""The closed language of stored graphs: every operator, function, method and attribute a
stored graph may name, each with the reason it is safe, reviewed one by one.

A stored graph is data that becomes code, and whoever can write a store (or hand over a
bundle) writes it. Deciding what it may call from operator schemas lost, three times, to
one more operator that takes sizes, strides, offsets or integers as addresses without
checking them against the memory they index (``aten::_reshape_alias`` read and wrote past
its input; ``Tensor.new(cdata=...)`` took an integer as a tensor's address). So the rule
is the other way round: **refused unless this table admits it.** What it admits:

- ATen operators by overload (``ATEN``), grouped by why they are safe: each checks the
  sizes, indices, dimensions and offsets it takes against the tensors it is given, or
  allocates what it returns. No ``out=`` variant is here (resizing an ``out`` tensor that
  is a view writes past the view, inside its storage), and no node may pass ``out``;
  what returns uninitialised memory (``empty``, ``empty_like``, ...: ``UNINITIALIZED``)
  is zero-filled when the graph runs as Python, so it never hands out what a freed
  tensor held. Nothing that builds a view from sizes, strides or an offset
  it does not check against the storage (``_reshape_alias``), reads or sets a storage or
  a raw address (``set_``, ``data_ptr``, ``untyped_storage``, ``from_blob``,
  ``Tensor.new``), or is an ``_unsafe_*`` / ``*_unsafe`` kernel that skips its checks
  (``_sparse_coo_tensor_unsafe``, ``_unsafe_index``), is here;
- this project's fused ops (``CACHEBUILD_OPS``);
- tensor methods (``METHODS``, and methods named after an admitted operator: every
  overload of it that the method can reach must be admitted), torch functions binding an
  admitted operator (likewise), and a few others (``TORCH_FUNCTIONS``, ``FUNCTIONAL``);
- Python's ``operator``, ``builtins`` and ``math`` functions in ``OPERATOR``,
  ``BUILTINS`` and ``MATH``; a graph run as Python calls the bounded version of each that
  could compute or allocate without end (``purity.bounded``);
- tensor attributes ``getattr`` may read (``TENSOR_ATTRIBUTES``).

Torch's own operator namespaces (``TORCH_NAMESPACES``) and this project's are closed: an
operator in one of them that is not a row here is refused. An operator of another
namespace is a library's the user imported (a splitting op, a model's custom op): it is
judged by its schema (``purity.op_impurity``), as the library declared it.

**Reviewing and versioning.** A row is added only after reading the kernel (CPU and CUDA)
for the checks its reason names; ``tests/test_trust_fuzz_ops.py`` runs every admitted
operator that takes sizes or indices, enumerated from torch's registry, with
out-of-range values in child processes, between canary tensors, and checks that the
loader refuses the rest. ``VERSION`` goes up with every change to what is admitted; it
enters every target's and entry's key (``env`` factors), so a graph stored under an
older table is never found, only built and checked again. A new torch version that registers a
namespace this table does not know fails ``tests/test_trust_language.py`` until it is
reviewed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Goes up with every change to what the table admits (see the module doc).
#: 2: aten::copy, convolutions, TorchScript's list and string slices; 3: tensor_split
#: (transformers' MoE routing); 4: _safe_softmax (scaled_dot_product_attention's math path
#: with a mask: softmax, then zeros where a whole row is masked, by ops that check ``dim``),
#: and the autocast switches of a ``with torch.autocast(...)`` block; 5: zero, diagonal_copy
#: and diagonal_scatter (what functionalisation makes of ``zero_`` and a write through
#: ``.diagonal()``), and the shifts of integer tensors (``a << 3``).
VERSION = 5


def _rows(reason: str, text: str) -> dict[str, str]:
    """``{"name.overload": reason}`` for lines ``name: overload overload ...`` of ``text``
    (``default`` stands for the overload without a name)."""
    rows = {}
    for line in text.strip().splitlines():
        name, _, overloads = line.partition(":")
        for overload in overloads.split():
            rows[f"{name.strip()}.{overload}"] = reason
    return rows


_ELEMENTWISE = _rows(
    "elementwise arithmetic, comparison, conversion or copy: the result's shape is the "
    "broadcast of the inputs' (checked); an in-place or out= result must hold that shape "
    "or is resized through its own storage", """
add: Scalar Tensor
add_: Scalar Tensor
sub: Scalar Tensor
sub_: Scalar Tensor
rsub: Scalar Tensor
mul: Scalar Tensor
mul_: Scalar Tensor
div: Scalar Scalar_mode Tensor Tensor_mode
div_: Scalar Scalar_mode Tensor Tensor_mode
true_divide: Scalar Tensor
floor_divide: Scalar default
remainder: Scalar Scalar_Tensor Tensor
fmod: Scalar Tensor
neg: default
neg_: default
abs: default
abs_: default
pow: Scalar Tensor_Scalar Tensor_Tensor
pow_: Scalar Tensor
sqrt: default
sqrt_: default
rsqrt: default
rsqrt_: default
exp: default
exp_: default
exp2: default
expm1: default
log: default
log_: default
log2: default
log10: default
log1p: default
sin: default
sin_: default
cos: default
cos_: default
tan: default
tanh: default
tanh_: default
sigmoid: default
sigmoid_: default
erf: default
erf_: default
reciprocal: default
reciprocal_: default
sign: default
sgn: default
floor: default
ceil: default
round: decimals default
trunc: default
clamp: Tensor default
clamp_: Tensor default
clamp_min: Tensor default
clamp_max: Tensor default
clip: Tensor default
maximum: default
minimum: default
where: Scalar ScalarOther ScalarSelf default self
lerp: Scalar Tensor
addcmul: default
addcdiv: default
eq: Scalar Tensor
ne: Scalar Tensor
lt: Scalar Tensor
le: Scalar Tensor
gt: Scalar Tensor
ge: Scalar Tensor
logical_and: default
logical_or: default
logical_not: default
logical_xor: default
bitwise_and: Scalar Scalar_Tensor Tensor
bitwise_or: Scalar Scalar_Tensor Tensor
bitwise_xor: Scalar Scalar_Tensor Tensor
bitwise_not: default
__lshift__: Tensor Scalar
__rshift__: Tensor Scalar
__ilshift__: Tensor Scalar
__irshift__: Tensor Scalar
bitwise_left_shift: Tensor Tensor_Scalar Scalar_Tensor
bitwise_right_shift: Tensor Tensor_Scalar Scalar_Tensor
bitwise_left_shift_: Tensor Tensor_Scalar
bitwise_right_shift_: Tensor Tensor_Scalar
isnan: default
isinf: default
isfinite: default
nan_to_num: default
square: default
fill: Scalar Tensor
fill_: Scalar Tensor
zero_: default
zero: default
masked_fill: Scalar Tensor
masked_fill_: Scalar Tensor
atan2: default
copy: default
copy_: default
_to_copy: default
to: device dtype dtype_layout other
type_as: default
clone: default
contiguous: default
""")

_ACTIVATIONS = _rows(
    "elementwise or row-wise on its input; takes no sizes or indices", """
relu: default
relu_: default
gelu: default
gelu_: default
silu: default
silu_: default
mish: default
hardtanh: default
hardswish: default
hardsigmoid: default
leaky_relu: default
elu: default
softplus: default
glu: default
softmax: int
log_softmax: int
_softmax: default
_log_softmax: default
_safe_softmax: default
dropout: default
native_dropout: default
""")

_REDUCTIONS = _rows(
    "reduces over dimensions, which are checked against the input's rank; topk's k is "
    "checked against the dimension's size; histc allocates its bins and drops values "
    "outside [min, max]", """
sum: default dim_IntList
histc: default
mean: default dim
amax: default
amin: default
max: default dim other
min: default dim other
argmax: default
argmin: default
prod: default dim_int
var: correction default dim
var_mean: correction default dim
std: correction default dim
std_mean: correction default dim
norm: Scalar ScalarOpt_dim ScalarOpt_dim_dtype ScalarOpt_dtype
linalg_vector_norm: default
cumsum: default
cumsum_: default
cumprod: default
any: default dim dims
all: default dim dims
logsumexp: default
topk: default
sort: default stable
argsort: default stable
""")

_PRODUCTS = _rows(
    "matrix products: operand shapes are checked against each other", """
mm: default dtype
bmm: default dtype
addmm: default dtype
baddbmm: default dtype
matmul: default
linear: default
einsum: default
addmv: default
mv: default
dot: default
outer: default
""")

_CONVOLUTIONS = _rows(
    "convolution: the weight's shape is checked against the input's channels and groups, "
    "stride and dilation must be positive, padding non-negative, and the output size is "
    "computed from them and checked to be positive before anything is read (Mamba's "
    "causal conv1d)", """
conv1d: default padding
conv2d: default padding
convolution: default
""")

_NORMS = _rows(
    "normalisation over trailing dimensions: normalized_shape and the weight's shape are "
    "checked against the input", """
layer_norm: default
native_layer_norm: default
rms_norm: default
_fused_rms_norm: default
group_norm: default
native_group_norm: default
""")

_ATTENTION = _rows(
    "dense attention: query, key, value and mask shapes are checked against each other "
    "(the variants taking cumulative lengths or offsets are not here)", """
scaled_dot_product_attention: default
_scaled_dot_product_flash_attention_for_cpu: default
_scaled_dot_product_attention_math: default
""")

_VIEWS = _rows(
    "a view or its copy: a new shape must hold the input's element count, and dimensions "
    "and slice bounds are checked (or clamped) against the sizes; as_strided and its "
    "family check sizes, strides and offset against the base's storage (setStorage); "
    "_unsafe_view is view without autograd's alias record, same checks", """
view: default dtype
view_copy: default dtype
reshape: default
_unsafe_view: default
expand: default
expand_copy: default
expand_as: default
permute: default
permute_copy: default
transpose: int
transpose_: default
transpose_copy: int
t: default
t_copy: default
t_: default
squeeze: default dim dims
squeeze_copy: default dim dims
unsqueeze: default
unsqueeze_copy: default
unsqueeze_: default
squeeze_: default dim dims
flatten: using_ints
unflatten: int
slice: Tensor
slice_copy: Tensor
slice_scatter: default
select: int
select_copy: int
select_scatter: default
narrow: Tensor default
split: Tensor sizes
split_with_sizes: default
split_copy: Tensor
split_with_sizes_copy: default
tensor_split: sections indices tensor_indices_or_sections
chunk: default
unbind: int
unbind_copy: int
alias: default
alias_copy: default
detach: default
detach_: default
detach_copy: default
movedim: int intlist
view_as: default
reshape_as: default
diagonal: default
diagonal_copy: default
diagonal_scatter: default
as_strided: default
as_strided_: default
as_strided_copy: default
as_strided_scatter: default
lift_fresh: default
lift_fresh_copy: default
view_as_real: default
view_as_complex: default
""")

_FACTORIES = _rows(
    "a new tensor with storage allocated for the shape (and strides) it is given: a size "
    "too large is an allocation error, never a view of memory it was not given", """
empty: memory_format
empty_like: default
empty_strided: default
zeros: default
zeros_like: default
ones: default
ones_like: default
full: default
full_like: default
arange: default start start_step
new_empty: default
new_empty_strided: default
new_zeros: default
new_ones: default
new_full: default
scalar_tensor: default
tril: default
triu: default
tril_: default
triu_: default
rand: default generator
randn: default generator
rand_like: default generator
randn_like: default generator
""")

_INDEXING = _rows(
    "indices are checked against the indexed dimension's size before any read or write; "
    "joins and pads check their operands' shapes", """
index: Tensor
index_put: default
index_put_: default
index_select: default
gather: default
scatter: reduce src value value_reduce
scatter_: reduce src value value_reduce
scatter_add: default
scatter_add_: default
index_copy: default
index_copy_: default
index_add: default
index_add_: default
index_fill: int_Scalar int_Tensor
index_fill_: int_Scalar int_Tensor
embedding: default
cat: default
stack: default
roll: default
flip: default
repeat: default
constant_pad_nd: default
pad: default
""")

_READS = _rows(
    "reads a size, stride, element count or one element (item) of a tensor it is given", """
sym_size: int
sym_stride: int
sym_numel: default
sym_storage_offset: default
size: int
stride: int
_local_scalar_dense: default
diff: default
""")

_SCRIPT = _rows(
    "TorchScript's overload of the name on a list or a string, which a call of the operator "
    "packet may reach (torch's associative_scan calls ``torch.ops.aten.slice``): a slice is "
    "no longer than what it slices, an index is checked against the length", """
slice: t str
select: t
""")

#: ATen operators a stored graph may call, by ``name.overload``, with why each is safe.
ATEN: dict[str, str] = {
    **_ELEMENTWISE, **_ACTIVATIONS, **_REDUCTIONS, **_PRODUCTS, **_CONVOLUTIONS, **_NORMS, **_ATTENTION,
    **_VIEWS, **_FACTORIES, **_INDEXING, **_READS, **_SCRIPT}

#: This project's fused ops (``cachebuild.passes.ops``), by name: each takes whole tensors;
#: on CPU it runs its reference (admitted operators), on CUDA a Triton kernel whose
#: launcher checks every size it is given against the tensors (``passes/ops/kernels.py``).
CACHEBUILD_OPS: dict[str, str] = {
    "rms_norm.default": "row-wise over the input's last dimension; weight checked against it",
    "fused_add_rms_norm.default": "rms_norm of input + residual, both of one shape",
    "static_scaled_fp8_quant.default": "elementwise, one scale",
    "dynamic_per_token_fp8_quant.default": "row-wise, one scale per row it allocates",
    "silu_and_mul.default": "row-wise over halves of the last dimension",
    "rotary_embedding.default": "rows and heads checked against the positions; a position "
                                "is an index (CPU) or clamped into the cache (CUDA)",
    "rms_norm_static_fp8_quant.default": "rms_norm, then elementwise quantisation",
    "fused_add_rms_norm_static_fp8_quant.default": "fused_add_rms_norm, then quantisation",
    "silu_and_mul_static_fp8_quant.default": "silu_and_mul, then quantisation",
    "qk_norm_rope.default": "head counts and sizes checked against qkv's rows and the "
                            "weights; positions as for rotary_embedding",
}
#: torch's functional collectives (``_c10d_functional``), as tensor-parallel pieces call
#: them: over a process group named by a string, which must already exist in this
#: process (a stored graph cannot make one); results are allocated from the input's
#: shape and the group's size, and ``wait_tensor`` waits for one.
COLLECTIVES: dict[str, str] = dict.fromkeys((
    "all_reduce.default", "all_reduce_.default", "wait_tensor.default",
    "all_gather_into_tensor.default", "reduce_scatter_tensor.default", "broadcast.default",
    "broadcast_.default"), "a collective on whole tensors over an existing process group")
#: The namespace of this project's ops (``cachebuild.passes.ops.NAMESPACE``).
CACHEBUILD_NAMESPACE = "cachebuild"

#: Namespaces torch itself registers operators in: closed, only ``ATEN`` rows run. (A
#: test fails when torch registers one that is not here.)
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "debugprims", "rngprims", "inductor", "inductor_prims", "_c10d_functional",
    "_c10d_functional_autograd", "c10d", "_dtensor", "_native", "_quantized", "quantized",
    "quantization", "_test", "debug_mode_ops", "export", "mkl", "mkldnn", "mkldnn_prepacked",
    "onednn", "profiler", "sparse", "static_runtime", "symm_mem", "prim", "higher_order",
    "_inductor_test", "streams", "torchao", "fbgemm", "torchvision", "triton", "tensorrt",
    "_higher_order_ops", "cuda", "xpu", "mps", "dist_c10d", "_c10d", "_operator", "aoti",
    "_quantized_decomposed", "quantized_decomposed", "_tritonparse", "prepacked"})

#: Tensor methods without an operator of their own name, and why each is safe.
METHODS: dict[str, str] = {
    **dict.fromkeys(("float", "double", "half", "bfloat16", "int", "long", "short", "bool",
                     "byte", "char", "cfloat", "cdouble"),
                    "a dtype conversion: a copy of the tensor it is called on"),
    **dict.fromkeys(("cpu", "cuda"), "a device copy of the tensor it is called on"),
    "type": "a dtype conversion (by dtype or its name) or a read of the type's name",
    "dim": "reads the tensor's rank", "ndimension": "reads the tensor's rank",
    "nelement": "reads the element count", "numel": "reads the element count",
    "element_size": "reads the element size", "is_contiguous": "reads a flag",
    "is_floating_point": "reads a flag", "is_complex": "reads a flag",
    "get_device": "reads the device index",
}
#: Operator methods (``x.__eq__(y)``: torch 2.11 and 2.12 keep some comparisons as
#: method calls). Only those that cannot compute or allocate without end whatever the
#: receiver is (a number, a list): never ``__add__``, ``__mul__``, ``__pow__``,
#: ``__lshift__`` (their ``operator`` functions are bounded instead) or ``__mod__``
#: (string formatting).
OPERATOR_METHODS: frozenset[str] = frozenset(
    f"__{r}{name}__" for name in ("eq", "ne", "lt", "le", "gt", "ge", "sub", "truediv",
                                  "floordiv", "matmul", "and", "or", "xor", "rshift")
    for r in ("", "r", "i")) | frozenset(
    ("__neg__", "__pos__", "__abs__", "__invert__", "__getitem__", "__setitem__",
     "__bool__", "__len__", "__float__", "__int__", "__index__"))

#: Other torch callables Dynamo records in graphs, by their path under ``torch``.
TORCH_FUNCTIONS: dict[str, str] = {
    "Size": "a shape tuple from sizes a model computes (GPT-2's attention)",
    "_C._set_grad_enabled": "Dynamo's grad-mode switch (per thread)",
    **dict.fromkeys(("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite",
                     "_sym_sqrt"), "symbolic-size arithmetic on plain numbers"),
    "sym_sum": "sums a list of sizes (the list is bounded like any stored list)",
    "tensor": "a new tensor copied from numbers the graph holds (a stored list is bounded)",
    **dict.fromkeys(("_check", "_check_is_size", "_assert"), "raises when its condition fails"),
}
#: Python functions of torch's a stored graph may call, by module: each runs admitted
#: operators on the tensors it is given, or (``torch.amp.autocast_mode``: a forward's
#: ``with torch.autocast(...)`` block) sets and puts back this thread's autocast state.
FUNCTIONAL: dict[str, frozenset[str]] = {
    "torch.amp.autocast_mode": frozenset({"_enter_autocast", "_exit_autocast"}),
    "torch.nn.functional": frozenset({
        "relu", "relu_", "gelu", "silu", "mish", "sigmoid", "tanh", "softmax", "log_softmax",
        "softplus", "leaky_relu", "elu", "hardtanh", "hardswish", "hardsigmoid", "glu",
        "dropout", "layer_norm", "rms_norm", "group_norm", "linear", "embedding", "pad",
        "normalize", "scaled_dot_product_attention"}),
    "torch.functional": frozenset({
        "einsum", "split", "norm", "broadcast_tensors", "broadcast_shapes", "tensordot",
        "meshgrid"}),
}

#: ``operator`` functions: arithmetic, comparison and indexing. ``mul``, ``add``,
#: ``concat``, ``pow``, ``lshift``, ``mod`` (and their in-place forms) run bounded.
OPERATOR: frozenset[str] = frozenset({
    "abs", "add", "and_", "concat", "contains", "eq", "floordiv", "ge", "getitem", "gt",
    "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "index",
    "invert", "ior", "ipow", "irshift", "isub", "itruediv", "ixor", "le", "lshift", "lt",
    "matmul", "mod", "mul", "ne", "neg", "not_", "or_", "pos", "pow", "rshift", "setitem",
    "sub", "truediv", "truth", "xor"})
#: Builtins: ``pow``, ``round`` and ``int`` run bounded.
BUILTINS: frozenset[str] = frozenset({
    "abs", "bool", "float", "int", "len", "max", "min", "pow", "round"})
#: ``math`` functions of one or two numbers (a float result, or an integer no larger
#: than its operands); ``prod`` and ``lcm`` run bounded. ``factorial``, ``comb``,
#: ``perm`` and the rest are not here.
MATH: frozenset[str] = frozenset({
    "sqrt", "isqrt", "ceil", "floor", "trunc", "fabs", "log", "log2", "log10", "log1p",
    "exp", "expm1", "pow", "sin", "cos", "tan", "tanh", "atan", "atan2", "erf", "isnan",
    "isinf", "isfinite", "copysign", "gcd", "prod", "lcm"})

#: Tensor attributes ``getattr`` may read: data, never the autograd graph or memory.
TENSOR_ATTRIBUTES: frozenset[str] = frozenset({
    "T", "mT", "H", "mH", "shape", "dtype", "device", "ndim", "layout", "real", "imag",
    "data", "grad", "requires_grad", "is_leaf", "is_cuda", "is_cpu", "is_meta",
    "is_quantized", "is_sparse", "is_nested", "itemsize", "nbytes"})


@functools.cache
def dispatcher_overloads(qualified: str) -> tuple[str, ...]:
    """The overload names (``default`` for none) the dispatcher registers for operator
    ``ns::name``: what a Python binding or tensor method of that name can reach."""
    prefix = qualified + "."
    found = []
    for op in torch._C._dispatch_get_all_op_names():
        if op == qualified:
            found.append("default")
        elif op.startswith(prefix):
            found.append(op[len(prefix):])
    return tuple(sorted(found))


def closed_table(namespace: str) -> dict[str, str] | None:
    """The rows admitted in ``namespace`` if the table closes it (torch's namespaces and
    this project's; empty for one with no rows), None for a library's namespace."""
    if namespace == "aten":
        return ATEN
    if namespace == CACHEBUILD_NAMESPACE:
        return CACHEBUILD_OPS
    if namespace == "_c10d_functional":
        return COLLECTIVES
    if namespace in TORCH_NAMESPACES:
        return {}
    return None


#: Operators that return uninitialised memory: a graph run as Python gets their results
#: zero-filled (``purity.bounded``); as tensor methods (which cannot be wrapped) they are
#: refused.
UNINITIALIZED = frozenset({"empty.memory_format", "empty_like.default", "empty_strided.default",
                           "new_empty.default", "new_empty_strided.default"})
_UNINITIALIZED_METHODS = frozenset({"new_empty", "new_empty_strided"})


@functools.cache
def is_out_variant(qualified: str) -> bool:
    """True if the overload ``ns::name.overload`` writes into keyword-only ``out``
    tensors: what a binding or method reaches only when given ``out=``, which no stored
    node may pass (see ``out_refusal``)."""
    name, _, overload = qualified.partition(".")
    namespace, _, op = name.partition("::")
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace), op), overload)._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
               for a in schema.arguments)


def out_refusal(kwargs: Any) -> str | None:
    """Why a node's keyword arguments are refused: an ``out`` tensor (resizing one that is
    a view writes past the view); None otherwise."""
    if isinstance(kwargs, dict) and "out" in kwargs:
        return "it passes an out= tensor, which stored graphs may not"
    return None


def overload_refusal(namespace: str, name: str, overloads: tuple[str, ...]) -> str | None:
    """Why a call that may reach ``ns::name`` at any of ``overloads`` is not in the
    closed language; None if every one is admitted, or if ``namespace`` is a library's
    (not closed here: ``purity`` judges it)."""
    table = closed_table(namespace)
    if table is None:
        return None
    if not overloads:
        return f"{namespace}::{name} is not a registered operator"
    for overload in overloads:
        if f"{name}.{overload}" not in table:
            shown = name if overload == "default" else f"{name}.{overload}"
            return f"{namespace}::{shown} is not in the table of operators stored graphs may call"
    return None


def op_refusal(op: Any) -> str | None:
    """Why the ``OpOverload`` or ``OpOverloadPacket`` ``op`` is refused by the table (a
    packet may reach every overload of its name that a call without ``out=`` and without
    dimension names can, TorchScript's on lists and strings included: see ``_callable``);
    None if admitted or a library's."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, _, name = op._schema.name.partition("::")
        return overload_refusal(namespace, name, (op._overloadname,))
    if isinstance(op, torch._ops.OpOverloadPacket):
        namespace, _, name = op._qualified_op_name.partition("::")
        return overload_refusal(namespace, name, packet_overloads(op._qualified_op_name))
    return f"{op!r} is not an operator"


def is_named_overload(overload: str) -> bool:
    """Whether an overload takes dimension names (a named-tensor one): known by its name,
    which holds ``dimname`` (any case), ``names`` or ``named`` (``size.Dimname``,
    ``index_copy_.dimname``, ``zeros.names``, ``flatten.named_out_dim``). Its schema
    cannot tell: torch 2.11 prints the type ``Dimname`` as ``str``; torch 2.13 registers
    none of them."""
    low = overload.lower()
    return "dimname" in low or "names" in low or "named" in low


def _callable(qualified: str, overloads: tuple[str, ...]) -> tuple[str, ...]:
    """The ``overloads`` of ``qualified`` a stored node can reach, so those the table must
    admit: not an ``out=`` variant (no node passes ``out``: ``out_refusal``), and not a
    named-tensor one where the name has others (no node passes a dimension name or
    names: ``named_refusal``; a tensor a stored graph is given has no names, and without
    them a named overload is never chosen). A name with only such overloads keeps them
    all, so it is judged (and refused) by them."""
    found = tuple(o for o in overloads if not is_out_variant(f"{qualified}.{o}"))
    unnamed = tuple(o for o in found if not is_named_overload(o))
    return unnamed or found


def packet_overloads(qualified: str) -> tuple[str, ...]:
    """The overloads a call of the operator packet ``qualified`` (``ns::name``) can reach
    (``_callable`` of every schema of the name, TorchScript's included)."""
    schemas = torch._C._jit_get_schemas_for_operator(qualified)
    return _callable(qualified, tuple(s.overload_name or "default" for s in schemas))


def reachable(name: str) -> tuple[str, ...]:
    """The overloads of ``aten::name`` a binding or method call in a stored graph can
    reach: what the table judges it by, and ``purity`` too."""
    return _reachable(name)


def _reachable(name: str) -> tuple[str, ...]:
    """The overloads of ``aten::name`` the dispatcher registers that a binding or method
    call in a stored graph can reach (``_callable``)."""
    return _callable(f"aten::{name}", dispatcher_overloads(f"aten::{name}"))


#: Parameters of Python functions (``FUNCTIONAL``) through which a call reaches a
#: named-tensor overload when given a string: a dimension by name, dimension names.
NAMED_PARAMETERS = frozenset({"dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim",
                              "out_dim", "outdim", "names"})


def _holds_str(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, list | tuple) and any(isinstance(v, str) for v in value)


def _takes_str(arg: Any) -> bool:
    # A string converts to a str or Device argument (Dimname is the named overloads').
    kind = str(arg.type)
    return "str" in kind or "Device" in kind


def _schemas(qualified: str, overloads: tuple[str, ...]) -> list[Any]:
    wanted = {"" if o == "default" else o for o in overloads}
    return [s for s in torch._C._jit_get_schemas_for_operator(qualified)
            if s.overload_name in wanted]


@functools.cache
def _string_slots(qualified: str, packet: bool) -> tuple[frozenset[int], frozenset[str]] | None:
    """The positions and keywords at which an overload of ``qualified`` that a call can
    reach (``_callable``: the table judges exactly those) takes a string; None for a name
    with no operator."""
    if packet:
        overloads = tuple(s.overload_name or "default"
                          for s in torch._C._jit_get_schemas_for_operator(qualified))
    else:
        overloads = dispatcher_overloads(qualified)
    if not overloads:
        return None
    positions: set[int] = set()
    keywords: set[str] = set()
    for schema in _schemas(qualified, _callable(qualified, overloads)):
        for i, a in enumerate(schema.arguments):
            if _takes_str(a):
                keywords.add(a.name)
                if not a.kwarg_only:
                    positions.add(i)
    return frozenset(positions), frozenset(keywords)


def named_refusal(qualified: str | None, args: Any, kwargs: Any, *, packet: bool = False,
                  parameters: tuple[str, ...] = ()) -> str | None:
    """Why a call is refused for passing a string where no overload the table judges
    takes one: that is how a call reaches a named-tensor overload (a dimension by name,
    ``names=``), which the table does not judge (``_callable``). For the operator
    ``qualified`` (a tensor method or a binding by its operator's name, or a ``packet``):
    a string, or a sequence holding one, at a position or keyword where no judged overload
    takes a ``str`` or ``Device``; for a Python function (``qualified`` None), at one of
    its ``parameters`` or keywords named in ``NAMED_PARAMETERS``. None otherwise. (A string
    a node computes is not seen here: the only ones a stored graph can compute are pieces
    of its constants and a tensor's type name.)"""
    args = args if isinstance(args, tuple | list) else ()
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    slots = _string_slots(qualified, packet) if qualified else None
    for i, value in enumerate(args):
        if not _holds_str(value):
            continue
        if slots is not None and i not in slots[0] or slots is None and (
                i < len(parameters) and parameters[i] in NAMED_PARAMETERS):
            return ("it passes a string where a dimension or a number goes (dimension names "
                    "are not in stored graphs' language)")
    for key, value in kwargs.items():
        if not _holds_str(value):
            continue
        if slots is not None and key not in slots[1] or slots is None and key in NAMED_PARAMETERS:
            return (f"it passes {key}= a string (dimension names are not in stored graphs' "
                    "language)")
    return None


@functools.cache
def binding_refusal(name: str) -> str | None:
    """Why torch's C function ``name`` (binding ``aten::name``: ``torch.cat``,
    ``torch._C._nn.linear``) is refused: any overload it can reach (without ``out=``,
    which no node passes) not admitted."""
    return overload_refusal("aten", name, _reachable(name))


@functools.cache
def method_refusal(name: str) -> str | None:
    """Why the tensor method ``name`` is refused; None if ``METHODS`` or
    ``OPERATOR_METHODS`` admits it, or every overload of ``aten::name`` it can reach is
    admitted."""
    if name in METHODS or name in OPERATOR_METHODS:
        return None
    overloads = _reachable(name)
    if not overloads or name in _UNINITIALIZED_METHODS:
        return f"Tensor.{name} is not in the table of methods stored graphs may call"
    return overload_refusal("aten", name, overloads)
