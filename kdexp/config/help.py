"""``python -m kdexp.run --help``: kdexp's own page, generated from the config itself so that it cannot go stale.

- the groups and their options are the YAML files of ``kdexp.conf`` (each option's description is its file's first
  comment line; the default is the one ``conf/config.yaml``'s defaults list picks);
- the keys, their types and defaults are the schema's dataclasses (kdexp.config.schema, with the loss and balancer
  fields of kdexp.losses.options); each key's note is the comment beside its field;
- the allowed values are read from the value rules themselves: the ``choice`` / ``number`` / ``integer`` / ``fail``
  calls of kdexp.config's checks and the ``check`` methods of kdexp.losses.options (parsed, never executed).

``conf/config.yaml`` sets ``hydra.help.template: ${kdexp_help:}``; Hydra substitutes ``$FLAGS_HELP`` in it with its
own flags (hydra._internal.hydra.Hydra.get_help), so the page ends with Hydra's flags.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf

from kdexp.config.qwen3 import QWEN3_SIZES

EXAMPLES = (
    ("one run (the embedded default with the Top-P loss, KD only)",
     "python -m kdexp.run loss=top_p loss.top_p=0.9 balancer.alpha=1.0"),
    ("a sweep: three points, one after another in this process",
     "python -m kdexp.run loss=top_p loss.top_p=0.9 -m balancer.alpha=0.5,0.9,1.0"),
    ("a sweep on SLURM, one 8-GPU node per point",
     "python -m kdexp.run -m loss=topk,top_p balancer.alpha=0.5,1.0 hydra/launcher=slurm_gpu parallel.tensor=8"),
)
HYDRA_LAUNCHER = "hydra/launcher"
# The page's order: the groups a run is made of first, where it runs and logs next, presets and their arms last;
# keys follow their group's place (parallel, launch and paths after trainer).
GROUP_ORDER = ("model", "loss", "balancer", "teacher", "rollout", "data", "trainer", "parallel", "logger", "launch",
               "paths", HYDRA_LAUNCHER, "experiment", "experiment_arm", "arm")
# Modules whose value rules name config keys: parsed for the "allowed" column.
RULE_MODULES = {"kdexp.config.checks": "", "kdexp.config.sources": "", "kdexp.config.rollout": "",
                "kdexp.losses.options": None}
WIDTH = 118


@dataclass
class Group:
    name: str
    options: list  # option names, sorted
    default: Optional[str]
    notes: dict  # option -> its file's first comment line


@dataclass
class Key:
    name: str  # dotted
    type: str
    default: Any
    note: str
    allowed: str


def model_names() -> list[str]:
    """What model.teacher / model.student take: the real Qwen3 sizes, smallest first, then the embedded pair."""
    def size(n: str) -> float:
        return float(n[:-1]) if n[:-1].replace(".", "").isdigit() else 0.0

    return sorted(QWEN3_SIZES, key=lambda n: (n.startswith("tiny"), size(n), n))


def _conf_dir() -> Path:
    """Where kdexp.conf's YAML files are, found without importing that package: kdexp.conf sits above this one (its
    import registers this module's resolver), and the page reads its files as data."""
    return Path(importlib.util.find_spec("kdexp.conf").origin).parent


def _first_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    return re.split(r"(?<=[\w)\]])\.\s+(?=[A-Z])|:\s+(?=[a-z]+=)", text, maxsplit=1)[0].rstrip(".:") if text else ""


def config_groups() -> dict[str, Group]:
    """Every config group of kdexp.conf (and hydra/launcher: Hydra's ``basic`` plus kdexp's presets)."""
    root = _conf_dir()
    defaults = {}
    for entry in yaml.safe_load((root / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            (key, value), = entry.items()
            defaults[key.replace("optional ", "").strip()] = value
    groups = {}
    for path in sorted(root.rglob("*.yaml")):
        if path.parent == root:
            continue
        name = path.parent.relative_to(root).as_posix()
        group = groups.setdefault(name, Group(name, [], defaults.get(name), {}))
        group.options.append(path.stem)
        group.notes[path.stem] = _first_comment(path)
    launcher = groups.get(HYDRA_LAUNCHER)
    if launcher is not None:
        launcher.options.append("basic")
        launcher.notes["basic"] = "Hydra's own: the points one after another in this process"
        launcher.default = "basic"
    for group in groups.values():
        group.options.sort(key=lambda o: (o != group.default, o))
    return {name: groups[name] for name in sorted(groups, key=_place)}


def _place(name: str) -> tuple:
    """Where a group (or a key, by its first part) goes on the page: GROUP_ORDER, then any other in name order."""
    head = name if name == HYDRA_LAUNCHER else name.split(".")[0]
    return (GROUP_ORDER.index(head) if head in GROUP_ORDER else GROUP_ORDER.index(HYDRA_LAUNCHER) - 0.5, name)


# --- keys: the schema -------------------------------------------------------------------------------------------------
@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """field name -> the comment beside it (and the comment lines right above it), from the class's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for i, line in enumerate(lines, start=1):
        m = re.match(r"^\s+(\w+)\s*:", line)
        if not m or line.strip().startswith("#"):
            continue
        above, j = [], i - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        out[m.group(1)] = " ".join(filter(None, [*above, comments.get(i, "")]))
    return out


def _comment(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if name in getattr(klass, "__dataclass_fields__", {}) and name in _field_comments(klass):
            text = _field_comments(klass)[name]
            if text:
                return text
    return ""


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0])}" if args else "list"
    if tp is Any:  # a key of several kinds (e.g. auto or a bool): its allowed values say which
        return "value"
    return getattr(tp, "__name__", str(tp))


def _plain(note: str, allowed: str) -> str:
    """A field's comment as the page says it: null for Python's None, and no constant's name where the allowed
    values already list them ("one of DIVERGENCES")."""
    note = re.sub(r"\bNone\b", "null", note)
    if allowed:
        note = re.sub(r"(;\s*)?\bone of [A-Z][A-Z0-9_]+\b(;\s*)?", lambda m: "; " if m.group(1) and m.group(2) else "",
                      note).strip()
    return note


def _value(x: Any) -> str:
    if x is None:
        return "null"
    if x is MISSING or x == MISSING:
        return "(set in conf/config.yaml)"
    if isinstance(x, bool):
        return str(x).lower()
    return str(x)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def schema_keys() -> list[Key]:
    """Every leaf key of the schema, in the schema's order, with its type, default, note and allowed values."""
    from kdexp.config.schema import KdexpConfig

    rules = value_rules()
    keys: list[Key] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            name = f"{prefix}{f.name}"
            allowed = "; ".join(rules.get(name, []))
            if name in ("model.teacher", "model.student"):
                allowed = "one of " + ", ".join(model_names())
            if not allowed and tp is bool:
                allowed = "true or false"
            keys.append(Key(name, _type_name(tp), _default(f), _plain(_comment(cls, f.name), allowed), allowed))

    walk(KdexpConfig, "")
    return sorted(keys, key=lambda k: _place(k.name)[0])  # stable: the schema's order within a group


# --- allowed values: the rules --------------------------------------------------------------------------------------
def _flat(node: ast.AST, bindings: dict, module: Any = None) -> Optional[str]:
    """A string literal, or an f-string whose fields are ``{prefix}``, a loop variable or ``{', '.join(CONSTANT)}``
    (else ``{}``, which the caller drops), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name):
                if v.value.id == "prefix":
                    parts.append("\0")  # the group prefix, e.g. "loss."
                elif v.value.id in bindings:
                    parts.append(bindings[v.value.id])
                else:
                    parts.append("{}")
            elif isinstance(v, ast.FormattedValue) and _joined(v.value, module) is not None:
                parts.append(_joined(v.value, module))
            else:
                parts.append("{}")
        return "".join(parts)
    return None


def _joined(node: ast.AST, module: Any) -> Optional[str]:
    """``', '.join(NAME)`` of a module-level tuple of strings, as the rule prints it."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" and \
            isinstance(node.func.value, ast.Constant) and len(node.args) == 1 and isinstance(node.args[0], ast.Name):
        values = getattr(module, node.args[0].id, None)
        if isinstance(values, dict):  # a table keyed by the allowed values (kdexp.losses.options.LOSS_NAMES)
            values = tuple(values)
        if isinstance(values, tuple) and all(isinstance(v, str) for v in values):
            return node.func.value.value.join(values)
    return None


def _const(node: ast.AST, module: Any) -> Any:
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    try:
        return ast.literal_eval(node)
    except ValueError:
        if all(isinstance(n, (ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(node)):
            return eval(compile(ast.Expression(node), "<rule>", "eval"), {"__builtins__": {}})  # numbers only
        return None


def _bound_text(kind: str, kw: dict) -> str:
    fmt = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
    if kind == "integer":
        parts = [f">= {fmt(kw['ge'])}" if "ge" in kw else "", f"< {fmt(kw['lt'])}" if "lt" in kw else ""]
        return "an integer " + " and ".join(p for p in parts if p) if any(parts) else "an integer"
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = [f"{ops[k]} {fmt(v)}" for k, v in kw.items() if k in ops]
    return "a finite number" + (" " + " and ".join(parts) if parts else "")


class _Rules(ast.NodeVisitor):
    def __init__(self, module: Any, prefix: Optional[str]):
        self.module, self.prefix, self.bindings, self.found = module, prefix, {}, {}

    def add(self, key: Optional[str], text: Optional[str], rule: bool = False) -> None:
        """``rule``: a choice/number/integer call; other texts count only when they say what the value must be."""
        if not key or not text or "{}" in key or "{}" in text or not (rule or text.startswith("must ")):
            return
        if "\0" in key:
            key = key.replace("\0", self.group or "")
        text = text.replace("\0", self.group or "")
        text = re.sub(r"^must be ", "", text)
        self.found.setdefault(key, [])
        if text not in self.found[key]:
            self.found[key].append(text)

    group: Optional[str] = None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        # kdexp.losses.options: KDLossOptions / SampledKDOptions are the loss group, BalancerOptions the balancer's
        self.group = {"KDLossOptions": "loss.", "SampledKDOptions": "loss.", "BalancerOptions": "balancer."}.get(
            node.name, self.prefix)
        self.generic_visit(node)
        self.group = self.prefix

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts):
            for e in node.iter.elts:
                self.bindings[node.target.id] = e.value
                for stmt in node.body:
                    self.visit(stmt)
            self.bindings.pop(node.target.id, None)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        args = node.args
        key = _flat(args[0], self.bindings, self.module) if args else None
        if func in ("choice",) and len(args) >= 3:
            values = _const(args[2], self.module)
            if isinstance(values, (tuple, list)):
                self.add(key, "one of " + ", ".join(_value(v) for v in values), rule=True)
        elif func in ("number", "integer") and args:
            kw = {k.arg: _const(k.value, self.module) for k in node.keywords if k.arg in ("gt", "ge", "lt", "le")}
            if None not in kw.values():
                self.add(key, _bound_text(func, kw), rule=True)
        elif func == "fail" and len(args) >= 3:
            self.add(key, _flat(args[2], self.bindings, self.module))
        elif func == "_fail" and len(args) >= 2:
            self.add("\0" + (key or "{}"), _flat(args[1], self.bindings, self.module))
        elif func == "ValueError" and args:
            text = _flat(args[0], self.bindings, self.module)
            m = re.match(r"^\0(\w+)=\{\} is invalid: (.*)$", text or "")
            if m:
                self.add("\0" + m.group(1), m.group(2))
        self.generic_visit(node)


@functools.cache
def value_rules() -> dict[str, list[str]]:
    """key -> what its rules say it must be, read from the rule modules' source (their literal keys and texts)."""
    found: dict[str, list[str]] = {}
    for name, prefix in RULE_MODULES.items():
        module = importlib.import_module(name)
        visitor = _Rules(module, prefix)
        visitor.group = prefix
        visitor.visit(ast.parse(inspect.getsource(module)))
        for key, texts in visitor.found.items():
            found.setdefault(key, []).extend(t for t in texts if t not in found.get(key, []))
    return found


# --- the page ---------------------------------------------------------------------------------------------------------
def _wrap(text: str, indent: int) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * indent)


def help_text() -> str:
    """kdexp's help page (without Hydra's flags, which Hydra appends through $FLAGS_HELP)."""
    out = ["kdexp.run: one knowledge-distillation run on megatron-core (a frozen teacher, a trained student, a logit KD",
           "loss mixed with the LM loss), composed from config groups; with -m, a sweep over any values.", "",
           "Usage: python -m kdexp.run [group=option ...] [key=value ...] [-m] [flags]", "", "Examples:"]
    for what, cmd in EXAMPLES:
        out += [f"  # {what}", f"  {cmd}"]
    out += ["", "== Config groups (group=option; * the default) =="]
    for group in config_groups().values():
        out.append(f"{group.name}: " + ", ".join(o + ("*" if o == group.default else "") for o in group.options))
        width = max(len(o) for o in group.options)
        for option in group.options:
            note = group.notes.get(option, "")
            out.append(textwrap.fill(f"{option.ljust(width)}  {note}", WIDTH, initial_indent="    ",
                                     subsequent_indent=" " * (width + 6)) if note else f"    {option}")
    out += ["", "== Keys (key=value): type, default, allowed values, what it is =="]
    for key in schema_keys():
        head = f"{key.name}: {key.type} = {_value(key.default)}"
        out.append(head)
        detail = "; ".join(filter(None, [f"allowed: {key.allowed}" if key.allowed else "", key.note]))
        if detail:
            out.append(_wrap(detail, 4))
    out += ["", "Full docs: README.md and docs/ (docs/running.md: the run directory, exit status, the checks).", ""]
    return "\n".join(out)


def template() -> str:
    """The Hydra help template: kdexp's page, then Hydra's flags. ``$`` is doubled (string.Template)."""
    return (help_text().replace("$", "$$") + "\n== Hydra flags ==\n$FLAGS_HELP\n"
            "Hydra's own groups (hydra/launcher, hydra/sweeper, ...) and settings: python -m kdexp.run --hydra-help\n")


if not OmegaConf.has_resolver("kdexp_help"):
    OmegaConf.register_new_resolver("kdexp_help", template)
