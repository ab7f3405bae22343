"""What an agent lets a shipped graph do: every node's operator is one of a fixed list of ATen operators, and
nothing in the graph's JSON is code. Torch-free, so the control plane refuses an upload for the same reason an
agent refuses to build from it.

Torch's deserializer resolves a node's `target` by name (any `torch.*` attribute), parses symbolic shape
expressions with `sympy.sympify` (an `eval`) and compiles `guards_code`; so this check runs on the JSON before
it, and whatever it does not list is refused: no file, network, process or storage operators (`aten::from_file`,
`aten::_pin_memory`...), no custom (non-aten) operators, no higher-order operators (subgraphs), no script
objects, no guards code, no expression beyond integer arithmetic on shape symbols.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from arceus.errors import SpecError

# ATen operators (the name torch's serializer writes, less "torch.ops.aten.") a captured layer may use: what
# torch.export's training IR of common vision, MLP and transformer models calls. Pure tensor math, shape and
# view operators, random-free or seeded by the caller (dropout), nothing that reads or writes outside tensors.
ALLOWED_ATEN = frozenset(
    f"{op}.{overload}"
    for op, overloads in {
        # elementwise and reductions
        "abs": ("default",), "add": ("Tensor", "Scalar"), "add_": ("Tensor", "Scalar"), "sub": ("Tensor", "Scalar"),
        "rsub": ("Tensor", "Scalar"), "mul": ("Tensor", "Scalar"), "div": ("Tensor", "Scalar", "Tensor_mode"),
        "neg": ("default",), "pow": ("Tensor_Scalar", "Tensor_Tensor", "Scalar"), "sqrt": ("default",),
        "rsqrt": ("default",), "exp": ("default",), "log": ("default",), "tanh": ("default",), "sin": ("default",),
        "cos": ("default",), "sigmoid": ("default",), "clamp": ("default", "Tensor"), "clamp_min": ("default",),
        "clamp_max": ("default",), "maximum": ("default",), "minimum": ("default",), "where": ("self", "ScalarSelf",
        "ScalarOther", "Scalar"), "eq": ("Tensor", "Scalar"), "ne": ("Tensor", "Scalar"), "lt": ("Tensor", "Scalar"),
        "le": ("Tensor", "Scalar"), "gt": ("Tensor", "Scalar"), "ge": ("Tensor", "Scalar"),
        "logical_not": ("default",), "logical_and": ("default",), "logical_or": ("default",),
        "bitwise_not": ("default",), "bitwise_and": ("Tensor",), "bitwise_or": ("Tensor",),
        "__and__": ("Tensor",), "__or__": ("Tensor",), "diff": ("default",),
        "sum": ("dim_IntList", "default"), "mean": ("dim", "default"), "amax": ("default",), "amin": ("default",),
        "max": ("dim", "default"), "min": ("dim", "default"), "argmax": ("default",), "cumsum": ("default",),
        "var": ("correction",), "std": ("correction",), "prod": ("default", "dim_int"), "all": ("default",),
        "any": ("default",), "masked_fill": ("Scalar", "Tensor"), "masked_fill_": ("Scalar", "Tensor"),
        "lerp": ("Scalar", "Tensor"), "erf": ("default",), "reciprocal": ("default",), "floor": ("default",),
        "fill_": ("Scalar",),
        # activations and normalisation
        "relu": ("default",), "relu_": ("default",), "gelu": ("default",), "silu": ("default",),
        "silu_": ("default",), "leaky_relu": ("default",), "hardtanh": ("default",), "hardtanh_": ("default",),
        "elu": ("default",), "softplus": ("default",), "mish": ("default",), "hardswish": ("default",),
        "hardsigmoid": ("default",), "softmax": ("int",), "log_softmax": ("int",), "_softmax": ("default",),
        "_log_softmax": ("default",), "layer_norm": ("default",), "group_norm": ("default",),
        "batch_norm": ("default",), "_native_batch_norm_legit_functional": ("default",),
        "_native_batch_norm_legit_no_training": ("default",), "native_layer_norm": ("default",),
        "rms_norm": ("default",), "dropout": ("default",), "native_dropout": ("default",),
        # linear algebra, convolution, pooling, attention
        "linear": ("default",), "matmul": ("default",), "mm": ("default",), "bmm": ("default",),
        "addmm": ("default",), "baddbmm": ("default",), "einsum": ("default",), "conv1d": ("default",),
        "conv2d": ("default",), "conv3d": ("default",), "convolution": ("default",),
        "max_pool2d": ("default",), "max_pool2d_with_indices": ("default",), "avg_pool2d": ("default",),
        "adaptive_avg_pool2d": ("default",), "_adaptive_avg_pool2d": ("default",), "adaptive_avg_pool1d": ("default",),
        "scaled_dot_product_attention": ("default",), "embedding": ("default",),
        # shapes, views, indexing, creation from shapes
        "view": ("default",), "reshape": ("default",), "_unsafe_view": ("default",), "flatten": ("using_ints",),
        "unflatten": ("int",), "permute": ("default",), "transpose": ("int",), "t": ("default",),
        "contiguous": ("default",), "clone": ("default",), "expand": ("default",), "expand_as": ("default",),
        "unsqueeze": ("default",), "squeeze": ("dim", "dims", "default"), "slice": ("Tensor",), "select": ("int",),
        "narrow": ("default",), "index": ("Tensor",), "index_select": ("default",), "gather": ("default",),
        "cat": ("default",), "stack": ("default",), "split": ("Tensor",), "split_with_sizes": ("default",),
        "chunk": ("default",), "unbind": ("int",), "repeat": ("default",), "roll": ("default",), "flip": ("default",),
        "tril": ("default",), "triu": ("default",), "to": ("dtype", "dtype_layout", "device"), "type_as": ("default",),
        "_to_copy": ("default",), "alias": ("default",), "detach": ("default",), "lift_fresh_copy": ("default",),
        "arange": ("default", "start", "start_step"), "zeros": ("default",), "ones": ("default",),
        "full": ("default",), "zeros_like": ("default",), "ones_like": ("default",), "full_like": ("default",),
        "empty": ("memory_format",), "new_zeros": ("default",), "new_ones": ("default",), "scalar_tensor": ("default",),
        "copy_": ("default",), "sym_size": ("int",), "sym_numel": ("default",), "sym_stride": ("int",),
        "_assert_scalar": ("default",), "sym_constrain_range_for_size": ("default",), "_assert_tensor_metadata":
        ("default",),
    }.items()
    for overload in overloads
)
# Python operators torch writes for integer arithmetic on shapes and for picking one output of several.
ALLOWED_PYTHON = frozenset(
    {"_operator.getitem", "_operator.add", "_operator.sub", "_operator.mul", "_operator.floordiv",
     "_operator.mod", "_operator.neg", "_operator.eq", "_operator.ge", "_operator.le", "_operator.gt",
     "_operator.lt", "_operator.ne", "_operator.truediv", "math.ceil", "math.floor", "math.sqrt"}
)
_ATEN = "torch.ops.aten."
# A symbolic shape expression as torch writes it (sympy's `srepr`: "Symbol('s77', positive=True, integer=True)"):
# integers, quoted shape symbols, arithmetic and a fixed set of sympy constructors and assumptions. No other
# names, no attributes, subscripts or other strings, so sympify's eval can build only a shape expression.
_EXPRESSION_TOKEN = re.compile(
    r"\s*(?:\d+|'[su]\d+'|Symbol|Integer|Rational|Mul|Add|Pow|Mod|FloorDiv|CeilDiv|PythonMod|CleanDiv|"
    r"IntTrueDiv|Max|Min|ToFloat|TruncToInt|positive|integer|nonnegative|True|False|[su]\d+|"
    r"\*\*|//|[-+*/(),<>=!%]=?)"
)
MAX_EXPRESSION_CHARS = 1000
# Argument kinds a node may take (the serializer's `Argument` union): tensors, symbolic and plain scalars,
# their lists, and optional ones. Not subgraphs (higher-order operators), script objects or operator handles.
_ALLOWED_ARGUMENTS = frozenset(
    {
        "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string",
        "as_strings", "as_sym_int", "as_sym_ints", "as_scalar_type", "as_memory_format", "as_layout", "as_device",
        "as_bool", "as_bools", "as_sym_bool", "as_sym_bools", "as_sym_float", "as_sym_floats",
        "as_optional_tensors", "as_optional_tensor", "as_int_lists", "as_string_to_argument",
    }
)


def graph_check(program: Any, where: str) -> None:
    """SpecError(`where`, why) unless `program` (a serialized ExportedProgram, parsed JSON) runs only allowed
    operators and holds no code: its reason names the first forbidden operator or field."""
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise SpecError(where, "is not a serialized torch.export program (no graph_module)")
    if program.get("guards_code"):
        raise SpecError(where, "carries guards_code (Python source); a shipped graph must carry none")
    graph = program["graph_module"].get("graph")
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        raise SpecError(where, "has no graph nodes")
    for node in graph["nodes"]:
        target = node.get("target") if isinstance(node, dict) else None
        if not isinstance(target, str):
            raise SpecError(where, "has a node without an operator name")
        if not operator_allowed(target):
            raise SpecError(
                where,
                f"uses operator {operator_name(target)}, which agents do not run (only listed ATen tensor "
                "operators: no file, network, process or custom operators, no higher-order operators)",
            )
        for kind in _argument_kinds(node.get("inputs")):
            if kind not in _ALLOWED_ARGUMENTS:
                raise SpecError(where, f"operator {operator_name(target)} takes a {kind} argument, which agents refuse")
    for expression in _expressions(program):
        if not expression_allowed(expression):
            raise SpecError(where, f"holds shape expression {expression[:80]!r}, which is not integer shape arithmetic")


def operator_allowed(target: str) -> bool:
    if target.startswith(_ATEN):
        return target.removeprefix(_ATEN) in ALLOWED_ATEN
    return target in ALLOWED_PYTHON


def operator_name(target: str) -> str:
    """"torch.ops.aten.from_file.default" → "aten::from_file" (how torch names operators in errors)."""
    if target.startswith("torch.ops."):
        namespace, _, rest = target.removeprefix("torch.ops.").partition(".")
        return f"{namespace}::{rest.rsplit('.', 1)[0] if rest.count('.') else rest}"
    return target


def expression_allowed(expression: str) -> bool:
    if len(expression) > MAX_EXPRESSION_CHARS:
        return False
    position = 0
    while position < len(expression):
        token = _EXPRESSION_TOKEN.match(expression, position)
        if token is None or token.end() == position:
            return expression[position:].strip() == ""
        position = token.end()
    return True


def _argument_kinds(inputs: Any) -> Iterator[str]:
    for named in inputs if isinstance(inputs, list) else ():
        argument = named.get("arg") if isinstance(named, dict) else None
        if not isinstance(argument, dict) or len(argument) != 1:
            yield "malformed"
            continue
        yield next(iter(argument))


def _expressions(value: Any) -> Iterator[str]:
    """Every string torch would parse as a sympy expression: `expr_str` fields and range-constraint keys."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "expr_str":
                yield item if isinstance(item, str) else "<not a string>"
            elif key == "range_constraints" and isinstance(item, dict):
                yield from item
            yield from _expressions(item)
    elif isinstance(value, list):
        for item in value:
            yield from _expressions(item)
