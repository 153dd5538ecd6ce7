"""Plain-int forms of the spec's rule functions, compiled once from their own source.

The rules in ``spec/rules.py`` and ``spec/fairness_rules.py`` are written with ``spec.logic``'s
``And``, ``Or``, ``Not``, ``Implies``, ``If``, ``Min``, ``Max`` and ``cdiv`` so that one source
runs on z3 terms (the proofs) and on ints (the scheduler). On ints those helpers cost a call
and a type test each, per request per tick. This module parses each rule function's source
once, at import, rewrites the helpers into Python's own operators (``and``, ``or``, ``not``,
``x if c else y``, ``min``, ``max``, ``-(-a // b)``) and compiles the result: the same rule, one
source, without the wrappers. ``tests/test_concrete_rules.py`` checks on random ints (hypothesis)
that every compiled form returns what its source returns.

The scheduler looks a rule up at call time and passes it through ``fast``: the compiled form
of that very function object, or the object itself when it has none (a rule replaced at run
time, as the planted-bug tests do, reaches the scheduler unchanged).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Callable

from spec import fairness_rules, rules

#: The modules whose functions are compiled.
MODULES = (rules, fairness_rules)


class _ToPython(ast.NodeTransformer):
    """Rewrite calls of ``spec.logic``'s helpers into Python operators (on ints they agree)."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f, args = node.func, node.args
        if not isinstance(f, ast.Name) or node.keywords or any(isinstance(a, ast.Starred) for a in args):
            return node
        name, n = f.id, len(args)
        if name in ("And", "Or") and n >= 2:
            return ast.BoolOp(op=ast.And() if name == "And" else ast.Or(), values=args)
        if name == "Not" and n == 1:
            return ast.UnaryOp(op=ast.Not(), operand=args[0])
        if name == "Implies" and n == 2:
            return ast.BoolOp(op=ast.Or(), values=[ast.UnaryOp(op=ast.Not(), operand=args[0]), args[1]])
        if name == "If" and n == 3:
            return ast.IfExp(test=args[0], body=args[1], orelse=args[2])
        if name in ("Min", "Max") and n == 2:
            return ast.Call(func=ast.Name(id=name.lower(), ctx=ast.Load()), args=args, keywords=[])
        if name == "cdiv" and n == 2:
            neg = ast.UnaryOp(op=ast.USub(), operand=args[0])
            return ast.UnaryOp(op=ast.USub(), operand=ast.BinOp(left=neg, op=ast.FloorDiv(), right=args[1]))
        return node


def _compile_module(module: types.ModuleType) -> dict[Callable, Callable]:
    """``{function: compiled plain-int function}`` for the functions defined in ``module``.

    The compiled functions share one namespace, a copy of the module's, in which the module's
    functions are replaced by their compiled forms (a rule calling another calls the compiled
    one; ``fast`` checks that the rules it calls are still the module's). A function whose
    source cannot be read (no .py file) is left out.
    """
    funcs = {name: f for name, f in vars(module).items()
             if isinstance(f, types.FunctionType) and f.__module__ == module.__name__}
    namespace = dict(vars(module))
    out: dict[Callable, Callable] = {}
    for name, f in funcs.items():
        try:
            src = textwrap.dedent(inspect.getsource(f))
        except (OSError, TypeError):
            continue
        tree = ast.parse(src)
        fn = tree.body[0]
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if not isinstance(fn, ast.FunctionDef):
            continue
        fn.decorator_list = []
        fn.returns = None  # annotations stay strings under `from __future__ import annotations`
        tree = ast.fix_missing_locations(_ToPython().visit(tree))
        code = compile(tree, filename=f"<spec.concrete {module.__name__}.{name}>", mode="exec")
        exec(code, namespace)  # noqa: S102 - our own source, rewritten
        compiled = namespace[name]
        compiled.__doc__ = f.__doc__
        compiled.__wrapped__ = f
        out[f] = compiled
        _DEPENDS[f] = tuple((module, g, funcs[g]) for g in sorted(calls & funcs.keys()) if g != name)
    return out


#: rule -> the rules of its module it calls: ``(module, name, function at import)``.
_DEPENDS: dict[Callable, tuple[tuple[types.ModuleType, str, Callable], ...]] = {}
_FAST: dict[Callable, Callable] = {}
for _m in MODULES:
    _FAST.update(_compile_module(_m))
for _f in _FAST:  # calls of calls too: growth_blocks -> blocks_needed -> blocks_for
    _all, _todo = set(), list(_DEPENDS[_f])
    while _todo:
        _d = _todo.pop()
        if _d not in _all:
            _all.add(_d)
            _todo.extend(_DEPENDS.get(_d[2], ()))
    _DEPENDS[_f] = tuple(sorted(_all, key=lambda d: (d[0].__name__, d[1])))


def fast(rule: Callable) -> Callable:
    """The plain-int compiled form of ``rule`` if this module compiled it and every rule it
    calls is still the module's own (none was replaced at run time), else ``rule`` itself."""
    compiled = _FAST.get(rule)
    if compiled is None:
        return rule
    for module, name, original in _DEPENDS[rule]:
        if getattr(module, name) is not original:
            return rule  # a rule it calls was replaced: the source form looks it up live
    return compiled


def compiled() -> dict[Callable, Callable]:
    """Every compiled rule: ``{source function: compiled function}`` (a copy)."""
    return dict(_FAST)


def describe(rule: Callable) -> str:
    """The compiled form's source, for reading (``python -m spec.concrete NAME``)."""
    for m in MODULES:
        if getattr(m, rule.__name__, None) is rule:
            tree = ast.parse(textwrap.dedent(inspect.getsource(rule)))
            return ast.unparse(ast.fix_missing_locations(_ToPython().visit(tree)))
    raise KeyError(rule.__name__)


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:] or [f.__name__ for f in _FAST]:
        for m in MODULES:
            if hasattr(m, arg):
                print(describe(getattr(m, arg)), end="\n\n")
                break
        else:
            raise SystemExit(f"no rule named {arg!r}")
