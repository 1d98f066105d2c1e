"""Arithmetic read out of a model's free-form answer: the final number and whether its
"a op b = c" lines are right.

The product reports the extracted answer next to its P(wrong) (:mod:`.scored`); lm-polygraph's
accuracy metric compares extracted numbers (:mod:`uhead_vllm.polygraph.processing`); the study
grades answers and labels steps with these (:mod:`uhead_vllm.tasks`). Pure Python: model text is
only parsed, never executed.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from decimal import Decimal, InvalidOperation
from typing import Callable, cast

__all__ = ["check_step_line", "extract_answer", "normalize_number", "safe_eval"]

# --------------------------------------------------------------------------------------------
# Numbers and the final answer
# --------------------------------------------------------------------------------------------

_MINUS = "\u2212\u2013\u2012\u2014\ufe63\uff0d"  # unicode minus, dashes used as minus
_MINUS_TABLE = str.maketrans({c: "-" for c in _MINUS})
# A number: thousands-grouped ("1,234.5") or plain ("-12", "3.75", ".5"); sign handled by caller.
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_SIGNED = rf"(?:[-+]\s?)?\$?\s?{_NUM}"
_ANSWER_RE = re.compile(
    rf"(?:answer\s*(?:is|:|=)|\\boxed\{{)[\s*:$=]*({_SIGNED})", re.IGNORECASE
)
_EQ_RE = re.compile(rf"=\s*\**\s*({_SIGNED})")
_NUM_RE = re.compile(rf"(?<![\w.])(-?{_NUM})")


def normalize_number(s: str) -> str | None:
    """Canonical string of a number ("1,000.0" -> "1000", "-0" -> "0", "+3.50" -> "3.5").

    reasoning-gym's basic_arithmetic scorer compares strings (partial credit on substrings), so
    "15.0" or "1,000" would be scored wrong unless normalised first.
    """
    t = s.translate(_MINUS_TABLE).replace(",", "").replace("$", "").replace(" ", "").strip()
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str | None) -> str | None:
    """Final numeric answer of a free-form response, normalised; None if there is no number.

    Order: the last "Answer: X" / "answer is X" / "\\boxed{X}", else the last "= X", else the
    last number. The 135M model often ignores the requested format, hence the fall-backs.
    """
    if not text:
        return None
    t = text.translate(_MINUS_TABLE)
    for rx in (_ANSWER_RE, _EQ_RE, _NUM_RE):
        hits = rx.findall(t)
        if hits:
            got = normalize_number(hits[-1])
            if got is not None:
                return got
    return None


# --------------------------------------------------------------------------------------------
# Step checking
# --------------------------------------------------------------------------------------------

_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNOPS: dict[type, Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPR = 200


def _ev(node: ast.AST) -> float:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_ev(node.left), _ev(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_ev(node.operand))
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return cast(float, node.value)  # an int or a float, checked just above
    raise ValueError(f"disallowed node {type(node).__name__}")


def _has_binop(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) for n in ast.walk(node))


def _parse(expr: str) -> ast.AST | None:
    """Parse only (never executes); returns the expression body or None."""
    if len(expr) > _MAX_EXPR:
        return None
    try:
        return ast.parse(expr.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def safe_eval(expr: str) -> float | None:
    """Value of an arithmetic expression of numbers, + - * /, unary +/- and parentheses.

    `ast` is only parsed and walked by hand; names, calls, attributes, ** etc. give None, so text
    from a model can never run code. Division by zero also gives None.
    """
    node = _parse(expr)
    if node is None:
        return None
    try:
        v = float(_ev(node))
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
        return None
    return v if math.isfinite(v) else None


_EXPR_CHARS = set("0123456789.+-*/() \t")
_VALUE_RE = re.compile(r"\s*(-\s?)?(\d+(?:\.\d+)?|\.\d+)")


def _clean_line(line: str) -> str:
    t = line.translate(_MINUS_TABLE).replace("×", "*").replace("·", "*").replace("÷", "/")
    t = t.replace("$", "").replace("**", " ")  # markdown bold, not powers (not asked for)
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", t)  # 1,234 -> 1234
    t = re.sub(r"(?<=\d)\s*[xX]\s*(?=[\d(])", " * ", t)  # 3 x 4 -> 3 * 4
    return t


def _lhs_value(left: str) -> float | None:
    """Value of the longest evaluable arithmetic suffix of `left` that contains an operator.

    Trimming from the left drops list numbers and prose ("Step 2. 3 + 4" -> "3 + 4").
    """
    i = len(left)
    while i > 0 and left[i - 1] in _EXPR_CHARS:
        i -= 1
    run = left[i:]
    for j in range(len(run)):
        if j and run[j - 1].isdigit() and run[j].isdigit():  # don't cut inside a number
            continue
        node = _parse(run[j:])
        if node is None or not _has_binop(node):
            continue
        try:
            return float(_ev(node))
        except (ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
            continue
    return None


def _equations(line: str) -> list[tuple[float, float, int]]:
    """(lhs value, stated value, stated decimals) of each checkable 'expr = value' in the line."""
    t = _clean_line(line)
    out = []
    for m in re.finditer(r"(?<![=<>!])=(?!=)", t):
        lhs = _lhs_value(t[: m.start()])
        val = _VALUE_RE.match(t, m.end())
        if lhs is None or val is None or not math.isfinite(lhs):
            continue
        digits = val.group(2)
        stated = float(digits) * (-1 if val.group(1) else 1)
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        out.append((lhs, stated, decimals))
    return out


def _matches(lhs: float, stated: float, decimals: int) -> bool:
    if math.isclose(lhs, stated, rel_tol=1e-6, abs_tol=1e-9):
        return True
    # "10 / 3 = 3.33": a value written with d decimals is right if it is lhs rounded to d places.
    return decimals > 0 and abs(lhs - stated) <= 0.5 * 10.0**-decimals + 1e-12


def check_step_line(line: str) -> bool | None:
    """True/False if every/any arithmetic equation "expr = value" in the line is right/wrong.

    Text around the equation is ignored ("So 3 * 4 = 12."), × ÷ x and unicode minus are accepted,
    chains "a + b = c + d = e" are checked link by link. None when nothing is checkable (no
    equation, no operator on the left, or only prose), so uncheckable steps stay unlabelled.
    """
    eqs = _equations(line)
    if not eqs:
        return None
    return all(_matches(*e) for e in eqs)
