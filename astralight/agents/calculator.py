"""A calculator tool for chat agents: one arithmetic expression in, its exact value out.

Evaluated from Python's own parse tree, never by ``eval``: numbers, ``+ - * / // % **``,
unary signs and parentheses, nothing else (a name, a call or an attribute is an error the model
reads back). Exponents and results are bounded, so a model cannot stall a RaaS worker with
``9**9**9``.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: the largest exponent and the most digits of any intermediate value
MAX_EXPONENT, MAX_DIGITS = 64, 100
#: the longest expression read
MAX_CHARS = 200


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        out = Fraction(_BINARY[type(node.op)](left, right))
        if len(str(abs(out.numerator))) > MAX_DIGITS:
            raise ValueError(f"a value has more than {MAX_DIGITS} digits")
        return out
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, "
                     f"not {ast.unparse(node)!r}")


def _text(value: Fraction) -> str:
    """An integer as digits; anything else as a decimal rounded to 10 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10f}".rstrip("0").rstrip(".")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "7 + 5" or "(12 - 3) * 4"
    """
    text = str(expression).strip()
    if not text:
        raise ValueError("expression is empty")
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**").replace("×", "*").replace("÷", "/"),
                         mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {text!r} as arithmetic") from None
    return _text(_value(tree.body))


__all__ = ["calculator"]
