"""docs/troubleshooting.md stays complete and true.

The page quotes the messages users meet as code spans on blockquote lines::

    > `ValueError: unit <unit> mixes dtypes: <path> is <dtype> but <path> is <dtype>`

(an optional exception or warning class, then the message with ``<placeholders>`` or ``...``
where the message varies). This test reads vfsdp/'s source with ``ast`` and checks both ways:

(a) complete: every message vfsdp can show a user has an entry. The messages are the string
    arguments of ``raise X("...")``, of exception constructors (``err = CheckpointError(...)``,
    raised later), of ``warnings.warn`` / ``warn_user``, of ``poison`` / ``_poison`` (what a
    ``ReleasedTensor`` raises), and the strings the BUILDERS below assemble. A message is
    covered by a quote whose literal text is found in the message's constant parts, in order
    (f-string fields are wildcards), and that quotes at least MIN_CHARS of it (or all of it,
    when it is shorter). A ``raise`` whose message is not a string must be listed in
    NOT_STRINGS (saying where its text comes from), and internal invariants in EXCLUDED.
(b) true: every quote on the page matches a message in vfsdp/ (no stale entries), with the
    class it names, and every NOT_STRINGS / EXCLUDED / BUILDERS key still exists.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vfsdp"
PAGE = ROOT / "docs" / "troubleshooting.md"

MIN_CHARS = 15  # literal characters a quote must share with a message (or all of a short one)
WILD = "\x00"   # an f-string field in a rendered message

# Calls whose argument is a message: name -> (argument index, class the user sees, or None
# for "the call's own name" / "any").
SINKS = {"warn": (0, None), "warn_user": (0, "UserWarning"), "poison": (1, "RuntimeError"),
         "_poison": (1, "RuntimeError"), "_untested": (0, "RuntimeWarning")}
EXC_NAME = re.compile(r"(Error|Exception|Mismatch|Warning|Exit|_Exists)$")
# What the user sees for an exception class that is not public.
SEEN_AS = {"_Exists": "FileExistsError"}

# Functions that assemble messages as plain strings (returned, or assigned and raised later):
# every string of >= MIN_CHARS literal characters they assign or return is a message.
BUILDERS = {
    ("vfsdp/testing/runners.py", "RankError.__init__"): "RankError's first line",
    ("vfsdp/testing/runners.py", "_describe"): "where a hung rank waits",
    ("vfsdp/testing/runners.py", "waiting_in_dump"): "where a hung process waits",
    ("vfsdp/testing/simulate.py", "_simulate"): "a rank thread that did not finish",
    ("vfsdp/testing/spawn.py", "spawn"): "a rank process that hung, crashed or said nothing",
    ("vfsdp/checkpoint/export.py", "from_state_dict"): "from_state_dict's source failure",
    ("vfsdp/checkpoint/io.py", "_write"): "a save's checksum failure",
    ("vfsdp/checkpoint/storage.py", "read_manifest"): "hints of a missing checkpoint",
    ("vfsdp/interop/dtensor.py", "_ragged_message"): "a ragged tensor in to_dtensor",
    ("vfsdp/collectives/comm.py", "_difference"): "how the ranks' specs differ",
}

# Messages whose last field is another message, which users read as one sentence:
# (file, function) of the outer message -> the (file, function)s of the inner ones.
_DBUFFER = "vfsdp/collectives/dbuffer.py"
_RUNNERS = "vfsdp/testing/runners.py"
_UNIT = "vfsdp/collectives/unit.py"
COMPOSED = {
    (_DBUFFER, "DBuffer._poison"): [(_DBUFFER, "DBuffer._release_views"),
                                    (_DBUFFER, "DBuffer.release_shard")],
    ("vfsdp/testing/simulate.py", "_simulate"): [(_RUNNERS, "_describe")],
    ("vfsdp/testing/spawn.py", "spawn"): [(_RUNNERS, "_describe"), (_RUNNERS, "waiting_in_dump")],
    (_RUNNERS, "_describe"): [(_RUNNERS, "_describe")],  # "waiting in ..." + " called from ..."
    ("vfsdp/collectives/comm.py", "_check"): [("vfsdp/collectives/comm.py", "_difference")],
    (_UNIT, "Unit._illegal"): [(_UNIT, "Unit.wait"), (_UNIT, "Unit.reshard"), (_UNIT, "Unit.post_backward")],
}

# ``raise`` statements whose message is not a string literal: (file, function, the raised
# expression) -> where the text the user sees comes from.
NOT_STRINGS = {
    ("vfsdp/__main__.py", "", "SystemExit(main())"): "the CLI's exit status, not a message",
    ("vfsdp/cli.py", "_checking", "_Refused"): "carries the bad input's own error (its cause), "
                                               "which main prints as one error: line",
    ("vfsdp/checkpoint/atomic.py", "prepare", "FileExistsError(value)"):
        "the text of _prepare_rank0's _Exists, sent from rank 0",
    ("vfsdp/checkpoint/export.py", "from_state_dict", "CheckpointError(err)"):
        "BUILDERS: from_state_dict; _check_source's CheckpointErrors, sent from src",
    ("vfsdp/checkpoint/io.py", "_write", "_unwrap(exc, 'vfsdp.checkpoint.save')"):
        "_unwrap: the rank's own error (+ ' (rank N)') or a CheckpointError constructed there",
    ("vfsdp/checkpoint/io.py", "_write", "CheckpointError(errors[0])"): "BUILDERS: _write",
    ("vfsdp/checkpoint/io.py", "load", "_unwrap(exc, 'vfsdp.checkpoint.load')"): "_unwrap",
    ("vfsdp/collectives/agree.py", "agree", "error"): "the rank's own error, raised as it was",
    ("vfsdp/optim/base.py", "begin", "_Dry"): "ends a member's update in a composition's "
                                              "checking pass; the composition catches it",
    ("vfsdp/planner/flatten.py", "flatten_with_path.walk", "_NotPlain"):
        "ends the planner's walk at a node it leaves to optree; flatten_with_path catches it",
    ("vfsdp/collectives/dbuffer.py", "ReleasedTensor.__torch_function__",
     "RuntimeError(why)"): "the poison()/_poison() sentences (SINKS)",
    ("vfsdp/interop/dtensor.py", "_placements", "ValueError(_ragged_message(t))"):
        "BUILDERS: _ragged_message",
    ("vfsdp/optim/traced.py", "traced_clip", "ValueError(refused)"):
        "the eager clip's own messages (resolve_groups, model_group), found by _norm_groups",
    ("vfsdp/testing/simulate.py", "_simulate", "RankError(real or failures)"):
        "BUILDERS: RankError.__init__, _simulate, _describe",
    ("vfsdp/testing/spawn.py", "spawn", "RankError(failures)"):
        "BUILDERS: RankError.__init__, spawn, _describe",
}

# Messages no user can meet: (file, function, a fragment of the message) -> why.
EXCLUDED = {
    ("vfsdp/testing/simulate.py", "_simulate", "simulate timed out"):
        "wakes hung rank threads; the user reads 'rank N did not finish within T s' instead",
}


@dataclass
class Message:
    file: str
    func: str
    line: int
    classes: Optional[set]  # the classes the user may see it as (None: any)
    text: str               # constant parts, WILD for each field, whitespace normalised
    kind: str = "raise"
    parts: list = field(default_factory=list, compare=False)  # a composed message's messages

    @property
    def literal(self) -> int:
        return len(self.text.replace(WILD, ""))

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.func}): {self.text.replace(WILD, '{}')!r}"


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _module_strings(tree: ast.Module) -> dict:
    """Module-level ``NAME = "text"`` constants, which f-strings may interpolate."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out[node.targets[0].id] = node.value.value
    return out


def _render(node: ast.AST, consts: dict) -> Optional[list]:
    """A message expression as pieces (str, or WILD for what varies); None: not a string."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                out.append(v.value)
            elif (isinstance(v.value, ast.Name) and v.value.id in consts and v.conversion == -1
                  and v.format_spec is None):
                out.append(consts[v.value.id])
            else:
                out.append(WILD)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left, consts), _render(node.right, consts)
        if left is None and right is None:
            return None
        return (left or [WILD]) + (right or [WILD])
    if isinstance(node, ast.IfExp):
        a, b = _render(node.body, consts), _render(node.orelse, consts)
        return None if a is None and b is None else [WILD]
    return None


def _text(pieces: list) -> str:
    return WILD.join(_norm(p) for p in "".join(pieces).split(WILD))


def _strings_in(node: ast.AST, consts: dict) -> list:
    """The strings an assigned or returned value is built from (through tuples, +, if-else)."""
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        r = _render(node, consts)
        return [r] if r else []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        whole = _render(node, consts)
        parts = _strings_in(node.left, consts) + _strings_in(node.right, consts)
        return ([whole] if whole else []) + parts
    if isinstance(node, ast.IfExp):
        return _strings_in(node.body, consts) + _strings_in(node.orelse, consts)
    if isinstance(node, ast.Tuple):
        return [s for e in node.elts for s in _strings_in(e, consts)]
    return []


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _warning_class(call: ast.Call) -> Optional[set]:
    cat = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "category"), None)
    if cat is None:
        return {"UserWarning"}
    return {ast.unparse(cat).split(".")[-1]}


def inventory() -> tuple[list, list]:
    """``(messages, non-string raises)`` of every module in vfsdp/."""
    messages, odd = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        consts = _module_strings(tree)
        raised_calls: set = set()

        def visit(node: ast.AST, stack: tuple) -> None:
            func = ".".join(stack)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for child in ast.iter_child_nodes(node):
                    visit(child, stack + (node.name,))
                return
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc
                text = None
                if isinstance(exc, ast.Call):
                    raised_calls.add(id(exc))
                    if exc.args:
                        text = _render(exc.args[0], consts)
                if text is None:
                    odd.append((rel, func, ast.unparse(exc), node.lineno))
                else:
                    name = _callee(exc)
                    cls = {SEEN_AS.get(name, name)} if EXC_NAME.search(name) else None
                    messages.append(Message(rel, func, node.lineno, cls, _text(text)))
            elif isinstance(node, ast.Call) and id(node) not in raised_calls:
                name = _callee(node)
                if name in SINKS:
                    index, cls = SINKS[name]
                    if len(node.args) > index:
                        text = _render(node.args[index], consts)
                        if text is not None:
                            classes = (_warning_class(node) if name in ("warn", "warn_user")
                                       else {cls} if cls else None)
                            messages.append(Message(rel, func, node.lineno, classes, _text(text),
                                                    kind=name))
                elif EXC_NAME.search(name) and node.args:
                    text = _render(node.args[0], consts)
                    if text is not None:
                        messages.append(Message(rel, func, node.lineno,
                                                {SEEN_AS.get(name, name)}, _text(text),
                                                kind="constructed"))
            elif (isinstance(node, (ast.Assign, ast.AugAssign, ast.Return))
                  and (rel, func) in BUILDERS and node.value is not None):
                for pieces in _strings_in(node.value, consts):
                    m = Message(rel, func, node.lineno, None, _text(pieces), kind="built")
                    if m.literal >= MIN_CHARS:
                        messages.append(m)
            for child in ast.iter_child_nodes(node):
                visit(child, stack)

        visit(tree, ())
    return messages, odd


# ------------------------------------------------------------------------------ the page

_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)")
_CLASS = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Mismatch|Warning|Exit)): (.*)$")
_HOLE = re.compile(r"<[^<>\s][^<>]*>|\.\.\.|…")


@dataclass
class Quote:
    line: int
    cls: Optional[str]
    text: str
    pieces: list  # its literal parts, in order
    pattern: re.Pattern
    literal: int


def quotes(page: str) -> list:
    """Every code span on a blockquote line of the page."""
    out = []
    for n, line in enumerate(page.splitlines(), 1):
        if not line.startswith(">"):
            continue
        for m in _SPAN.finditer(line):
            raw = m.group(2).strip() if len(m.group(1)) > 1 else m.group(2)
            cls = None
            c = _CLASS.match(raw)
            if c:
                cls, raw = c.group(1).split(".")[-1], c.group(2)
            pieces = [_norm(p) for p in _HOLE.split(_norm(raw))]
            pattern = re.compile(".*?".join(re.escape(p) for p in pieces), re.DOTALL)
            out.append(Quote(n, cls, raw, [p for p in pieces if p], pattern,
                             sum(len(p) for p in pieces)))
    return out


def covers(q: Quote, m: Message) -> bool:
    return (q.literal >= min(MIN_CHARS, m.literal) and all(p in m.text for p in q.pieces)
            and bool(q.pattern.search(m.text)))


def compose(messages: list) -> list:
    """The COMPOSED sentences: each outer message with its last field filled by an inner one
    (two levels deep)."""
    by_func: dict = {}
    for m in messages:
        by_func.setdefault((m.file, m.func), []).append(m)
    out, layer = [], messages
    for _ in range(2):
        made = []
        for outer in layer:
            if not outer.text.endswith(WILD):
                continue
            last = (outer.parts or [outer])[-1]  # the message whose field is still open
            for key in COMPOSED.get((last.file, last.func), ()):
                for inner in by_func.get(key, ()):
                    made.append(Message(outer.file, outer.func, outer.line, outer.classes,
                                        outer.text[:-1] + inner.text, "composed",
                                        (outer.parts or [outer]) + (inner.parts or [inner])))
        out += made
        layer = made
    return out


def _excluded(m: Message) -> bool:
    return any(m.file == f and m.func == fn and frag in m.text for f, fn, frag in EXCLUDED)


def _check(page: str, messages: list, odd: list) -> list:
    """Every problem with the page, as lines (empty: complete and true)."""
    problems = []
    qs = quotes(page)
    if not qs:
        return ["the page quotes no messages"]
    every = messages + compose(messages)
    hits = {id(q): [m for m in every if covers(q, m)] for q in qs}
    covered = {id(p) for found in hits.values() for m in found for p in (m.parts or [m])}
    for m in messages:
        if not _excluded(m) and id(m) not in covered:
            problems.append(f"no entry for {m.where()}")
    for q in qs:
        found = hits[id(q)]
        if not found:
            problems.append(f"troubleshooting.md:{q.line}: {q.text!r} is in no vfsdp message")
        elif q.cls and not any(m.classes is None or q.cls in m.classes for m in found):
            seen = sorted({c for m in found for c in m.classes or ()})
            problems.append(f"troubleshooting.md:{q.line}: {q.text!r} is raised as {seen}, "
                            f"not {q.cls}")
    known = set(NOT_STRINGS)
    for rel, func, expr, line in odd:
        if (rel, func, expr) not in known:
            problems.append(f"{rel}:{line} ({func}): raise {expr} has no string message; "
                            f"add an entry to the page for its text and list it in NOT_STRINGS")
    found_odd = {(r, f, e) for r, f, e, _ in odd}
    problems += [f"stale NOT_STRINGS key {k}" for k in known - found_odd]
    for f, fn, frag in EXCLUDED:
        if not any(m.file == f and m.func == fn and frag in m.text for m in messages):
            problems.append(f"stale EXCLUDED key {(f, fn, frag)}")
    funcs = {(m.file, m.func) for m in messages if m.kind == "built"}
    problems += [f"BUILDERS key {k} builds no message" for k in BUILDERS if k not in funcs]
    funcs = {(m.file, m.func) for m in messages}
    problems += [f"COMPOSED key {k} names no message" for k, inner in COMPOSED.items()
                 for k in [k] + inner if k not in funcs]
    return problems


def test_every_message_has_an_entry_and_every_entry_a_message():
    messages, odd = inventory()
    assert len(messages) > 250, len(messages)  # the inventory itself works
    problems = _check(PAGE.read_text(), messages, odd)
    assert not problems, "\n".join(problems)


def test_a_new_raise_without_an_entry_fails(tmp_path):
    """The check catches a new message, a stale quote and a non-string raise."""
    messages, odd = inventory()
    page = PAGE.read_text()
    new = Message("vfsdp/x.py", "f", 1, {"ValueError"},
                  _text(["vfsdp.frobnicate: the widget ", WILD, " is not frobbable"]))
    assert any("no entry for vfsdp/x.py" in p for p in _check(page, messages + [new], odd))
    stale = page + "\n> `ValueError: this message was never raised by anything`\n"
    assert any("is in no vfsdp message" in p for p in _check(stale, messages, odd))
    wrong = page + "\n> `KeyError: unit <unit> mixes dtypes: <path> is <dtype>`\n"
    assert any("not KeyError" in p for p in _check(wrong, messages, odd))
    assert any("has no string message" in p
               for p in _check(page, messages, odd + [("vfsdp/x.py", "f", "E(msg)", 1)]))


def test_matching_reads_f_strings_and_placeholders():
    tree = ast.parse('def f(p, n):\n    raise ValueError(f"granularity {n} does not divide '
                     '{p} (shape {s}); use   a divisor"\n                     f" of {n}")\n')
    call = tree.body[0].body[0].exc
    m = Message("x.py", "f", 1, {"ValueError"}, _text(_render(call.args[0], {})))
    q = quotes("> `ValueError: granularity <k> does not divide <path> (shape <shape>); use a "
               "divisor of <n>`")[0]
    assert covers(q, m) and q.cls == "ValueError"
    assert not covers(quotes("> `granularity <k> divides <path>`")[0], m)
    assert not covers(quotes("> `does not`")[0], m)  # too short to identify the message
