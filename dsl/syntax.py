"""Text -> syntax tree: the lark tree (from `parser`) converted to `nodes`.

    >>> module = parse("mesh dp=2\\nuse zero3() on dp\\n", file="x.pps")
    >>> module.items[1].name.name
    'zero3'

A file with syntax errors is parsed again with each bad statement blanked
out, so one run reports every syntax error (up to `MAX_SYNTAX_ERRORS`).
"""
from __future__ import annotations

from lark import Token, Tree
from lark.exceptions import UnexpectedInput

from piper.diagnostics import Diagnostic, PiperError, Span

from . import nodes as n
from .parser import BadDedent, raw_parse
from .syntax_errors import describe

MAX_SYNTAX_ERRORS = 10
# Deeper trees than this are refused before any recursive walk (about 3 Python
# frames per level, well inside the interpreter's default recursion limit).
MAX_NESTING = 100


def parse(text: str, file: str = "<script>") -> n.Module:
    """Parse a script; raise `PiperError` carrying every syntax error found."""
    module, diagnostics = parse_recovering(text, file)
    if module is None:
        raise PiperError(*diagnostics)
    return module


def parse_recovering(text: str, file: str = "<script>") -> tuple[n.Module | None, list[Diagnostic]]:
    """Parse `text`: (module, []) when it is well formed, else (None, syntax diagnostics)."""
    diagnostics: list[Diagnostic] = []
    work = text
    fixed: set[int] = set()
    while len(diagnostics) < MAX_SYNTAX_ERRORS:
        try:
            tree = raw_parse(work)
        except (UnexpectedInput, BadDedent) as err:
            diagnostic, line, mode = describe(err, work, file, text)
            if line in fixed:  # the error is in our own stand-in text: stop here
                break
            diagnostics.append(diagnostic)
            fixed.add(line)
            work = _blank(work, line, mode)
            continue
        if diagnostics:
            return None, diagnostics
        too_deep = _too_deep(tree, file, text)
        if too_deep:
            return None, [too_deep]
        return _Convert(file, text).module(tree), []
    return None, diagnostics


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t\f"))


def _is_code(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _blank(text: str, line: int, mode: str) -> str:
    """Remove the statement on 1-based `line` so parsing can go on past it.

    mode "statement": the line becomes a do-nothing `let _ = 0` (so a block that
    held only this line stays a block) and the lines indented under it go.
    mode "indent": the line and the lines after it indented at least as far go.
    """
    lines = text.split("\n")
    index = line - 1
    if not 0 <= index < len(lines):
        return text
    indent = _indent_of(lines[index])
    if mode == "statement":
        lines[index] = lines[index][:indent] + "let _ = 0"
    else:
        lines[index] = ""
    for j in range(index + 1, len(lines)):
        if not _is_code(lines[j]):
            continue
        deeper = _indent_of(lines[j]) > indent if mode == "statement" else _indent_of(lines[j]) >= indent
        if not deeper:
            break
        lines[j] = ""
    return "\n".join(lines)


def _too_deep(tree: Tree, file: str, text: str) -> Diagnostic | None:
    """A diagnostic when the tree nests deeper than MAX_NESTING (checked without recursion)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            span = Span(file, meta.line, meta.column, meta.end_line, meta.end_column, text) \
                if not meta.empty else None
            return Diagnostic("nesting-limit", f"this script nests deeper than {MAX_NESTING} levels",
                              span=span, hint="split the expression with `let`, or flatten the blocks")
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, Tree))
    return None


def _to_int(digits: str) -> int:
    """The literal's value; absurdly long literals become 10**40, which the interpreter refuses as too large."""
    return int(digits) if len(digits) <= 40 else 10**40


def _unquote(token: str) -> str:
    """The text of a string literal: drop the quotes, undo backslash escapes."""
    body = token[3:-3] if token.startswith('"""') else token[1:-1]
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append({"n": "\n", "t": "\t"}.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


class _Parts:
    """Spans, selectors and expressions: the leaves `_Convert` builds statements from."""

    def __init__(self, file: str, source: str):
        self.file = file
        self.source = source

    # ---- spans

    def tok_span(self, tok: Token) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column, self.source)

    def span(self, tree: Tree) -> Span:
        m = tree.meta
        return Span(self.file, m.line, m.column, m.end_line, m.end_column, self.source)

    def header(self, tree: Tree, last: Span) -> Span:
        """From the start of a compound statement to the end of its header's last part."""
        m = tree.meta
        return Span(self.file, m.line, m.column, last.end_line, last.end_column, self.source)

    def name(self, tok: Token) -> n.Name:
        return n.Name(str(tok), self.tok_span(tok))

    # ---- selectors

    def slot(self, tree: Tree) -> n.Slot:
        return n.Slot(tuple(self.pass_selector(p) for p in tree.children), tree.data == "slot_group",
                      self.span(tree))

    def region(self, tree: Tree) -> n.Region:
        return n.Region(tuple(self.tag(t) for t in tree.children), self.span(tree))

    def pass_selector(self, tree: Tree) -> n.PassSelector:
        op, *tags = tree.children
        return n.PassSelector(self.name(op), tuple(self.tag(t) for t in tags), self.span(tree))

    def tag(self, tree: Tree) -> n.Tag:
        name, value = tree.children
        is_any = isinstance(value, Token) and value.type == "STAR"
        return n.Tag(self.name(name), None if is_any else self.expr(value), self.span(tree))

    # ---- expressions

    def expr(self, tree: Tree):
        kind = tree.data
        c = tree.children
        span = self.span(tree)
        if kind == "int_lit":
            return n.Int(_to_int(c[0]), span)
        if kind == "bool_lit":
            return n.Bool(c[0].type == "TRUE", span)
        if kind == "name":
            return n.Name(str(c[0]), span)
        if kind == "call":
            return n.Call(self.name(c[0]), tuple(self.expr(x) for x in c[1:]), span)
        if kind == "negate":
            return n.Unary("-", self.expr(c[1]), span)
        if kind == "not_op":
            return n.Unary("not", self.expr(c[0]), span)
        if kind in ("arith", "compare"):
            return n.Binary(str(c[1]), self.expr(c[0]), self.expr(c[2]), span)
        if kind in ("and_op", "or_op"):
            return n.Binary("and" if kind == "and_op" else "or", self.expr(c[0]), self.expr(c[1]), span)
        raise AssertionError(f"unhandled expression {kind}")


class _Convert(_Parts):
    """Turns lark's tree into `nodes`, attaching a `Span` to every node."""

    # ---- top level

    def module(self, tree: Tree) -> n.Module:
        return n.Module(self.file, self.source, tuple(self.item(child) for child in tree.children))

    def item(self, tree: Tree):
        if tree.data == "mesh_stmt":
            axes = tuple(n.MeshAxis(self.name(a.children[0]), n.Int(_to_int(a.children[1]),
                                                                      self.tok_span(a.children[1])),
                                    self.span(a)) for a in tree.children)
            return n.Mesh(axes, self.span(tree))
        if tree.data == "import_stmt":
            return n.Import(_unquote(tree.children[0]), self.span(tree))
        if tree.data == "strategy_def":
            return self.strategy(tree)
        return self.stmt(tree)

    def strategy(self, tree: Tree) -> n.Strategy:
        name_tok, params, *rest = tree.children
        doc = None
        if rest and isinstance(rest[0], Tree) and rest[0].data == "docstring":
            doc = _unquote(rest[0].children[0])
            rest = rest[1:]
        name = self.name(name_tok)
        return n.Strategy(name, tuple(self.param(p) for p in params.children), doc,
                          tuple(self.stmt(s) for s in rest), self.header(tree, name.span))

    def param(self, tree: Tree) -> n.Param:
        name, *rest = tree.children
        type_ = next((self.name(c) for c in rest if isinstance(c, Token)), None)
        default = next((self.expr(c) for c in rest if isinstance(c, Tree)), None)
        return n.Param(self.name(name), type_, default, self.span(tree))

    # ---- statements

    def block(self, tree: Tree) -> tuple:
        return tuple(self.stmt(child) for child in tree.children)

    def stmt(self, tree: Tree):
        kind = tree.data
        c = tree.children
        span = self.span(tree)
        if kind == "let_stmt":
            return n.Let(self.name(c[0]), self.expr(c[1]), span)
        if kind == "split_stmt":
            return n.Split(self.name(c[0]), tuple(self.expr(x) for x in c[1:]), span)
        if kind == "place_stmt":
            return n.Place(self.region(c[0]), self.name(c[1]), self.expr(c[2]), span)
        if kind == "shard_stmt":
            of = next((x for x in c if isinstance(x, Tree) and x.data == "shard_of"), None)
            names = [x for x in c[:-1] if isinstance(x, Token)]
            patterns = () if of is None else tuple(n.Pattern(_unquote(t), self.tok_span(t)) for t in of.children)
            return n.Shard(tuple(self.name(x) for x in names), self.name(c[-1]), span, patterns)
        if kind == "recompute_stmt":
            return n.Recompute(tuple(self.region(r) for r in c), span)
        if kind == "use_stmt":
            on = self.name(c[2]) if len(c) > 2 else None
            return n.Use(self.name(c[0]), tuple(self.arg(a) for a in c[1].children), on, span)
        if kind in ("for_stmt", "order_for"):
            var, start, _, stop, body = c
            stop_expr = self.expr(stop)
            return n.For(self.name(var), self.expr(start), stop_expr, self.block(body),
                         self.header(tree, stop_expr.span))
        if kind in ("if_stmt", "order_if"):
            cond = self.expr(c[0])
            orelse = self.block(c[2].children[0]) if len(c) > 2 else ()
            return n.If(cond, self.block(c[1]), orelse, self.header(tree, cond.span))
        if kind == "order_stmt":
            region = self.region(c[0])
            return n.Order(region, self.block(c[1]), self.header(tree, region.span))
        if kind == "slots":
            return n.Slots(tuple(self.slot(s) for s in c), span)
        raise AssertionError(f"unhandled statement {kind}")

    def arg(self, tree: Tree) -> n.Arg:
        if tree.data == "named_arg":
            return n.Arg(self.name(tree.children[0]), self.expr(tree.children[1]), self.span(tree))
        return n.Arg(None, self.expr(tree.children[0]), self.span(tree))
