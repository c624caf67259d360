"""Static checks of vLLM's Python sources against what the plugin uses, for
every release series :data:`vllm_lowrank.compat.SUPPORTED_VLLM` names.

Nothing of vLLM is imported: both sides are read by AST. The installed vLLM is
read for its own series; every other series is read from its release wheel
(``vllm==SERIES.0``, fetched once by ``pip download`` into ``conftest.VLLM_WHEELS`` and
unpacked there without installing; skipped when it cannot be fetched). What
the plugin uses is derived from its sources, so a new import, override or
compat function is covered without editing this file:

- every ``import vllm...`` / ``from vllm... import X`` (in functions too), and
  every attribute the plugin reads or replaces on such an imported module or
  class (``engine_utils.zmq_socket_ctx``, ``AttentionType.DECODER``);
- every class of the plugin derived from a vLLM class: the methods and class
  attributes it overrides, the ``self`` attributes it reads without setting
  them and the ``super()`` calls it makes (keywords included);
- the constructor keywords of vLLM's model and attention classes that
  :mod:`vllm_lowrank.models.architectures` reads;
- the vLLM private names ``compat.py`` reaches, still in the modules that
  define them in the installed vLLM, with the same parameters;
- and that no module other than ``compat.py`` touches a vLLM private name.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import textwrap

import pytest

import vllm_lowrank
from conftest import release_sources
from vllm_lowrank import compat

OURS = pathlib.Path(vllm_lowrank.__file__).parent
"""The plugin's package folder."""

OTHER_LIBRARIES = {"_attn_implementation": "transformers' PretrainedConfig (calibration)",
                   "_fields": "the standard library's typing.NamedTuple (kernel launch arguments)"}
"""Private names of other libraries that vLLM's sources happen to define too."""


# -- reading a vLLM release's sources ----------------------------------------


def _read(path: pathlib.Path) -> ast.Module | None:
    """The AST of a Python file, or ``None`` when it does not parse."""
    try:
        return ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return None


@functools.lru_cache(maxsize=None)
def _parse(path: str) -> ast.Module | None:
    """:func:`_read`, kept for the next lookup in the same module."""
    return _read(pathlib.Path(path))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function's parameters as ``(a, b=, *, c, **kw)``: names, kinds and
    which have defaults (annotations and default values left out)."""
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [p.arg + ("=" if i >= first_default else "") for i, p in enumerate(positional)]
    if a.posonlyargs:
        out.insert(len(a.posonlyargs), "/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg + ("" if d is None else "=") for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return "(" + ", ".join(out) + ")"


def _accepts(params: str, keyword: str) -> bool:
    """Whether a function with ``params`` (:func:`_params`) takes ``keyword``."""
    names = [p.rstrip("=") for p in params.strip("()").split(", ")]
    return keyword in names or any(n.startswith("**") for n in names)


def _top_level(tree: ast.Module):
    """The module-level statements of ``tree``, those under ``if`` / ``try`` /
    ``with`` blocks included (``if TYPE_CHECKING:`` re-exports)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body
        elif isinstance(node, ast.With):
            todo += node.body
        else:
            yield node


def _assigned(node) -> list[str]:
    """Names an assignment statement binds."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for target in targets:
        out += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return out


def private_definitions(tree: ast.AST) -> dict[str, set[str | None]]:
    """Names with one leading underscore that ``tree`` defines anywhere
    (functions, methods, classes, attributes or variables it assigns), each with
    the parameters (:func:`_params`) of its function definitions; ``None``
    stands for a definition that is not a function."""
    out: dict[str, set[str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name, params = node.name, _params(node)
        elif isinstance(node, ast.ClassDef):
            name, params = node.name, None
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name, params = node.attr, None
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name, params = node.id, None
        else:
            continue
        if name.startswith("_") and not name.startswith("__"):
            out.setdefault(name, set()).add(params)
    return out


def own_members(cls: ast.ClassDef) -> dict[str, str | None]:
    """The members a class body defines: methods (with :func:`_params`),
    class attributes and nested classes (``None``), and attributes its methods
    assign on ``self`` (``None``, unless a method of that name exists)."""
    out: dict[str, str | None] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = _params(node)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.setdefault(sub.attr, None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            out.update(dict.fromkeys(_assigned(node)))
        elif isinstance(node, ast.ClassDef):
            out[node.name] = None
    return out


@dataclasses.dataclass(frozen=True)
class Found:
    """What a name resolves to in a release: ``kind`` is ``"module"``
    (``module`` is it), ``"class"`` (defined in ``module`` as ``node``),
    ``"value"`` (a function or variable of ``module``) or ``"external"``
    (imported from outside vLLM)."""

    kind: str
    module: str
    node: ast.ClassDef | None = None


class Release:
    """The Python sources of one vLLM release, read by AST.

    Args:
        root: The folder holding the ``vllm`` package.
        version: Its version (for messages).
    """

    def __init__(self, root: pathlib.Path, version: str) -> None:
        self.root = root
        self.version = version

    def __repr__(self) -> str:
        return f"vLLM {self.version} ({self.root})"

    def path(self, module: str) -> pathlib.Path | None:
        """The file of a dotted ``vllm...`` module, or ``None`` when there is none."""
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def tree(self, module: str) -> ast.Module | None:
        """A module's AST, or ``None`` when there is no such module."""
        path = self.path(module)
        return None if path is None else _parse(str(path))

    def _package(self, module: str) -> str:
        """The package a module's relative imports start from."""
        path = self.path(module)
        return module if path is not None and path.name == "__init__.py" \
            else module.rpartition(".")[0]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module a (possibly relative) ``from ... import`` in ``module`` names."""
        if not node.level:
            return node.module or ""
        package = self._package(module)
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return ".".join(p for p in (package, node.module) if p)

    def resolve(self, module: str, name: str | None = None, _seen=None) -> Found | None:
        """What ``name`` is in ``module`` (the module itself when ``name`` is
        ``None``): a top-level definition or re-export (``if TYPE_CHECKING:``
        and star imports followed), or a submodule; ``None`` when the release
        has no such module or the module does not define ``name``."""
        if not (module == "vllm" or module.startswith("vllm.")):
            return Found("external", module)
        tree = self.tree(module)
        if tree is None:
            return None
        if name is None:
            return Found("module", module)
        seen = _seen or set()
        if (module, name) in seen:
            return None
        seen.add((module, name))
        stars = []
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Found("class", module, node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found("value", module)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned(node):
                return Found("value", module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        return self.resolve(alias.name)
                    if alias.asname is None and alias.name.split(".")[0] == name:
                        return self.resolve(name)
            if isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        sub = self.resolve(f"{source}.{alias.name}")
                        if sub is not None and sub.kind == "module":
                            return sub
                        return self.resolve(source, alias.name, seen)
        if self.path(f"{module}.{name}") is not None:
            return Found("module", f"{module}.{name}")
        for source in stars:
            found = self.resolve(source, name, seen)
            if found is not None:
                return found
        return None

    def members(self, found: Found) -> dict[str, str | None]:
        """The members of a class (``found.kind == "class"``): its methods
        (with :func:`_params`), class attributes, and attributes its methods
        assign on ``self`` (``None``), its vLLM base classes' included (the
        nearest definition wins). Bases from outside vLLM add nothing."""
        out: dict[str, str | None] = {}
        for base in reversed(found.node.bases):  # an earlier base wins
            while isinstance(base, ast.Subscript):  # Generic[T]
                base = base.value
            parts = []
            while isinstance(base, ast.Attribute):
                parts.insert(0, base.attr)
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            target = self.resolve(found.module, base.id)
            for part in parts:
                target = target and target.kind == "module" and self.resolve(target.module, part)
            if target and target.kind == "class":
                out.update(self.members(target))
        out.update(own_members(found.node))
        return out

    @functools.cached_property
    def private_names(self) -> dict[str, set[str]]:
        """Every private name (:func:`private_definitions`) the release defines,
        with the modules defining it."""
        out: dict[str, set[str]] = {}
        for path in self.root.joinpath("vllm").rglob("*.py"):
            tree = _read(path)  # not kept: the whole of vLLM
            if tree is None:
                continue
            module = ".".join(path.relative_to(self.root).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            for name in private_definitions(tree):
                out.setdefault(name, set()).add(module)
        return out


# -- fetching a release -------------------------------------------------------


@functools.lru_cache(maxsize=None)
def installed_release() -> Release:
    """The installed vLLM's sources (nothing imported)."""
    spec = importlib.util.find_spec("vllm")
    root = pathlib.Path(next(iter(spec.submodule_search_locations))).parent
    return Release(root, importlib.metadata.version("vllm"))


@functools.lru_cache(maxsize=None)
def release_for(series: str) -> Release:
    """The sources of vLLM ``series`` (``"0.33"``): the installed package when
    it is of that series, else the ``SERIES.0`` release wheel
    (:func:`release_sources`).

    Raises:
        RuntimeError: from :func:`release_sources`.
    """
    installed = installed_release()
    if re.match(rf"{re.escape(series)}\.", installed.version):
        return installed
    return Release(release_sources(f"{series}.0"), f"{series}.0")


@pytest.fixture(scope="module")
def reference() -> Release:
    """The installed vLLM: the release the plugin is tested against, where
    the private names and parameters the other series are compared with come from."""
    return installed_release()


@pytest.fixture(scope="module", params=compat.SUPPORTED_VLLM)
def release(request) -> Release:
    """Each supported vLLM series' sources; the tests using it are skipped,
    with pip's reason, when a wheel cannot be fetched."""
    try:
        return release_for(request.param)
    except RuntimeError as e:
        pytest.skip(f"vLLM {request.param} sources unavailable: {e}")


# -- what the plugin uses -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Use:
    """One vLLM name the plugin uses: ``module`` itself (``name`` ``None``),
    ``name`` imported from it, or attribute ``attr`` read or replaced on that
    imported name. ``where`` is ``path:line`` under the package."""

    where: str
    module: str
    name: str | None = None
    attr: str | None = None

    def __str__(self) -> str:
        target = ".".join(p for p in (self.name, self.attr) if p)
        return f"{self.where}: {self.module}" + (f": {target}" if target else "")


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def _sources(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root), ast.parse(path.read_text())


def _vllm_imports(tree: ast.Module, rel) -> tuple[list[Use], dict[str, Use]]:
    """Every vLLM import of a module (in functions too) as a :class:`Use`, and
    the local names they bind, each with what it is bound to (the last
    binding of a name in the file wins)."""
    imports, bindings = [], {}
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and not node.level and _is_vllm(node.module):
            for alias in node.names:
                imports.append(Use(where, node.module, alias.name))
                bindings[alias.asname or alias.name] = imports[-1]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    imports.append(Use(where, alias.name))
                    if alias.asname:
                        bindings[alias.asname] = imports[-1]
                    else:  # `import vllm.a.b` binds `vllm`
                        bindings[alias.name.split(".")[0]] = Use(where, "vllm")
    return imports, bindings


def _named_attributes(node) -> list[tuple[str, str]]:
    """``(object name, attribute)`` pairs a node names: ``x.attr``, an
    attribute named by string (``x.__dict__["attr"]``), and a call whose
    first two arguments are a name and a string (``getattr(x, "attr")``,
    ``setattr``, the ``EngineArgs`` wrapping of ``patches._wrap``)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return [(node.value.id, node.attr)]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "__dict__" and isinstance(node.value.value, ast.Name) \
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return [(node.value.value.id, node.slice.value)]
    if isinstance(node, ast.Call) and len(node.args) >= 2 \
            and isinstance(node.args[0], ast.Name) and isinstance(node.args[1], ast.Constant) \
            and isinstance(node.args[1].value, str):
        return [(node.args[0].id, node.args[1].value)]
    return []


def vllm_uses(root: pathlib.Path = OURS) -> list[Use]:
    """Every vLLM import of the Python files under ``root`` (in functions too),
    and every attribute (dunders aside) read, assigned or named by string
    (:func:`_named_attributes`) on a name such an import binds, in the same
    file (scopes are not told apart)."""
    out = []
    for rel, tree in _sources(root):
        imports, bindings = _vllm_imports(tree, rel)
        out += imports
        for node in ast.walk(tree):
            for name, attr in _named_attributes(node):
                if name in bindings and not attr.startswith("__"):
                    out.append(dataclasses.replace(bindings[name],
                                                   where=f"{rel}:{node.lineno}", attr=attr))
    return out


def _self_reads(cls: ast.ClassDef) -> dict[str, int]:
    """Attributes the class's methods read on ``self`` (first line of each)."""
    out: dict[str, int] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.setdefault(node.attr, node.lineno)
    return out


def _super_calls(cls: ast.ClassDef) -> list[tuple[int, str, list[str]]]:
    """``(line, method, keywords)`` of every ``super().method(...)`` call."""
    out = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Call) \
                and isinstance(node.func.value.func, ast.Name) \
                and node.func.value.func.id == "super":
            out.append((node.lineno, node.func.attr,
                        [k.arg for k in node.keywords if k.arg is not None]))
    return out


@dataclasses.dataclass
class Subclass:
    """A class of the plugin derived from vLLM classes.

    Attributes:
        where: ``path:line`` of the class.
        name: Its name.
        bases: The :class:`Use` of each vLLM base class.
        defines: Its methods (with :func:`_params`) and class attributes
            (``None``), and the attributes it assigns on ``self`` (``None``).
        self_reads: Attributes it reads on ``self``, with their lines.
        super_calls: From :func:`_super_calls`.
    """

    where: str
    name: str
    bases: list[Use]
    defines: dict[str, str | None]
    self_reads: dict[str, int]
    super_calls: list[tuple[int, str, list[str]]]


def vllm_subclasses(root: pathlib.Path = OURS) -> list[Subclass]:
    """The classes under ``root`` (nested ones included) with a base class
    imported from vLLM."""
    out = []
    for rel, tree in _sources(root):
        bindings = _vllm_imports(tree, rel)[1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for base in node.bases:
                while isinstance(base, ast.Subscript):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bindings:
                    bases.append(bindings[base.id])
            if bases:
                out.append(Subclass(f"{rel}:{node.lineno}", node.name, bases, own_members(node),
                                    _self_reads(node), _super_calls(node)))
    return out


def _subscript_keys(fn, argument: str) -> set[str]:
    """String keys a function subscripts its parameter ``argument`` with
    (``a["prefix"]``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {n.slice.value for n in ast.walk(tree)
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
            and n.value.id == argument and isinstance(n.slice, ast.Constant)
            and isinstance(n.slice.value, str)}


def _base_calls(fn) -> dict[str, set[str]]:
    """``{method: keywords}`` of the calls ``base.method(...)`` in ``fn``'s source."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "base":
            out.setdefault(node.func.attr, set()).update(
                k.arg for k in node.keywords if k.arg is not None)
    return out


def architecture_uses() -> list[tuple[str, str, set[str]]]:
    """``(architecture, "module:Class", needed)`` for the vLLM classes of
    every supported architecture: the attention class with the constructor
    arguments its ``settings`` function and the latent-attention factory read
    by key, and the model class with the methods :func:`lowrank_class` calls
    on it (``"method"``, and ``"method:keyword"`` for each keyword passed)."""
    from vllm_lowrank.models import architectures, causal_lm

    factory = _subscript_keys(causal_lm._latent_attention, "arguments")
    model = {f"{method}:{k}" for method, keys in _base_calls(causal_lm.lowrank_class).items()
             for k in keys} | set(_base_calls(causal_lm.lowrank_class))
    out = []
    for name, arch in architectures.ARCHITECTURES.items():
        settings = arch.settings
        argument = next(iter(inspect.signature(settings).parameters))
        out.append((name, arch.attention,
                    {f"__init__:{k}" for k in _subscript_keys(settings, argument) | factory}))
        out.append((name, arch.model, model))
    return out


# -- the checks ---------------------------------------------------------------


def missing_uses(release: Release, uses: list[Use]) -> list[str]:
    """The uses whose module, name or attribute the release does not define
    (an attribute is checked on modules and classes only)."""
    out = []
    for use in uses:
        found = release.resolve(use.module, use.name)
        if found is None:
            out.append(f"{use}: not in {release}")
        elif use.attr is None or found.kind == "external":
            continue
        elif found.kind == "module" and release.resolve(found.module, use.attr) is None:
            out.append(f"{use}: no {use.attr} in module {found.module} of {release}")
        elif found.kind == "class" and use.attr not in release.members(found):
            out.append(f"{use}: class {use.name} of {release} has no {use.attr}")
    return out


def subclass_problems(release: Release, reference: Release, classes: list[Subclass]
                      ) -> list[str]:
    """What breaks the plugin's vLLM subclasses in ``release``, one line each:
    a base class gone; a member the class overrides gone, or a method of it
    whose parameters differ from ``reference``'s; a ``self`` attribute the
    class reads but does not set that its bases lack; a ``super()`` call of a
    missing method or with a keyword the method does not take. Only members
    the vLLM bases define in ``reference`` count (the others are the
    plugin's own, or come from bases outside vLLM such as torch's
    ``nn.Module``)."""
    out = []
    for cls in classes:
        members: dict[str, str | None] = {}
        ref_members: dict[str, str | None] = {}
        for base in cls.bases:
            found = release.resolve(base.module, base.name)
            if found is None or found.kind != "class":
                out.append(f"{cls.where}: {cls.name}'s base {base.module}.{base.name} "
                           f"is not a class of {release}")
                continue
            members = {**release.members(found), **members}
            ref = reference.resolve(base.module, base.name)
            if ref is not None and ref.kind == "class":
                ref_members = {**reference.members(ref), **ref_members}
        if not members:
            continue  # no base left: reported above
        for name in cls.defines:
            if name not in ref_members or (name.startswith("__") and name != "__init__"):
                continue  # the plugin's own member, or a dunder of every class
            if name not in members:
                out.append(f"{cls.where}: {cls.name}.{name} overrides a member its vLLM "
                           f"bases no longer have in {release}")
            elif members[name] != ref_members[name]:
                out.append(f"{cls.where}: {cls.name}.{name} overrides "
                           f"{members[name]} in {release}, {ref_members[name]} in {reference}")
        for name, line in cls.self_reads.items():
            if name in ref_members and name not in cls.defines and name not in members:
                out.append(f"{cls.where}: {cls.name} reads self.{name} (line {line}), "
                           f"which its vLLM bases do not define in {release}")
        for line, method, keywords in cls.super_calls:
            if method not in ref_members:
                continue  # a method of a base from outside vLLM (torch's nn.Module)
            if method not in members:
                out.append(f"{cls.where}: {cls.name} calls super().{method} (line {line}), "
                           f"not defined in {release}")
                continue
            for k in keywords:
                if members[method] is not None and not _accepts(members[method], k):
                    out.append(f"{cls.where}: {cls.name} calls super().{method}({k}=...) "
                               f"(line {line}); {release} takes {members[method]}")
    return out


def architecture_problems(release: Release, uses) -> list[str]:
    """The vLLM model and attention classes of :func:`architecture_uses`
    that ``release`` lacks, or whose methods lack what is needed."""
    out = []
    for arch, path, needed in uses:
        module, name = path.split(":")
        found = release.resolve(module, name)
        if found is None or found.kind != "class":
            out.append(f"{arch}: {path} is not a class of {release}")
            continue
        members = release.members(found)
        for need in sorted(needed):
            method, _, keyword = need.partition(":")
            if method not in members:
                out.append(f"{arch}: {path} has no {method} in {release}")
            elif keyword and not _accepts(members[method] or "()", keyword):
                out.append(f"{arch}: {path}.{method} takes no {keyword} in {release} "
                           f"{members[method]}")
    return out


def our_private_names(root: pathlib.Path = OURS) -> set[str]:
    """The private names the Python files under ``root`` define."""
    return {name for _, tree in _sources(root) for name in private_definitions(tree)}


def compat_private_names(reference: Release) -> set[str]:
    """The private names ``compat.py`` reads, calls or imports that the
    reference vLLM defines (and the plugin does not)."""
    ours = our_private_names()
    return {name for _, name in _private_uses(OURS / "compat.py")
            if name in reference.private_names and name not in ours}


def private_problems(release: Release, reference: Release, names: set[str]) -> list[str]:
    """The private ``names`` that ``release`` no longer defines where
    ``reference`` does, one line each: a module defining a name in
    ``reference`` that ``release`` still has but without that name, or with
    other function parameters; or a name none of whose ``reference`` modules
    exists any more (a module gone as a whole is tolerated while another
    defining module remains)."""
    out = []
    for name in sorted(names):
        modules = sorted(reference.private_names.get(name, ()))
        if not modules:
            out.append(f"{name}: not defined in the reference {reference}")
            continue
        remaining = 0
        for module in modules:
            tree = release.tree(module)
            if tree is None:
                continue
            remaining += 1
            defs = private_definitions(tree).get(name)
            ref_defs = private_definitions(reference.tree(module))[name]
            if defs is None:
                out.append(f"{name}: no longer defined in {module} of {release}")
            elif defs != ref_defs:
                out.append(f"{name} in {module}: {sorted(map(str, defs))} in {release}, "
                           f"{sorted(map(str, ref_defs))} in {reference}")
        if not remaining:
            out.append(f"{name}: none of {', '.join(modules)} exists in {release}")
    return out


def _private_uses(path) -> list[tuple[int, str]]:
    """``(line, name)`` of every private attribute a module reads or calls
    (``x._name``) and every private name it imports from vLLM."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
            out += [(node.lineno, a.name) for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


# -- tests --------------------------------------------------------------------


def test_vllm_names_we_import_exist(release):
    """Every vLLM module the plugin imports exists and defines each imported
    name, and each attribute used on an imported module or class."""
    uses = vllm_uses()
    named = {(u.name, u.attr) for u in uses}
    assert ("EngineArgs", "create_engine_config") in named  # wrapped by name (patches.py)
    assert ("utils", "zmq_socket_ctx") in named  # replaced on the module (serve_entry.py)
    missing = missing_uses(release, uses)
    assert not missing, "\n".join(missing)


def test_our_vllm_subclasses_match(release, reference):
    """The plugin's subclasses of vLLM classes override members that exist
    with the reference parameters, read ``self`` attributes their bases set,
    and call ``super()`` methods with keywords they take."""
    classes = vllm_subclasses()
    assert {"LatentAttention", "ExactTokensSpec", "ExactTokensManager",
            "LatentAttentionImpl"} <= {c.name for c in classes}
    problems = subclass_problems(release, reference, classes)
    assert not problems, "\n".join(problems)


def test_architecture_classes_take_what_we_read(release):
    """vLLM's model and attention classes of every supported architecture
    exist and take the constructor arguments the plugin reads."""
    uses = architecture_uses()
    assert any("__init__:prefix" in needed for _, _, needed in uses)
    problems = architecture_problems(release, uses)
    assert not problems, "\n".join(problems)


def test_compat_private_names_exist(release, reference):
    """Each vLLM private name ``compat.py`` touches is still defined, with the
    same parameters, in the modules that define it in the installed vLLM."""
    names = compat_private_names(reference)
    assert {"_remove_blocks_in_range", "_get_num_evictable_blocks",
            "_compute_cos_sin_cache", "_encode_layer_name", "_ensure_registered"} <= names
    problems = private_problems(release, reference, names)
    assert not problems, "\n".join(problems)


def test_the_checks_see_a_missing_name(reference, tmp_path):
    """Each check reports a planted name the installed vLLM lacks."""
    assert missing_uses(reference, [Use("x.py:1", "vllm.utils.torch_utils", "_no_such")]) \
        == ["x.py:1: vllm.utils.torch_utils: _no_such: not in " + str(reference)]
    assert missing_uses(reference, [Use("x.py:1", "vllm.no_such_module")])
    assert missing_uses(reference, [Use("x.py:1", "vllm.v1.attention.backend",
                                        "AttentionType", "NO_SUCH")])
    assert private_problems(reference, reference, {"_no_such_private"})
    assert architecture_problems(reference, [("X", "vllm.model_executor.models.llama:"
                                              "LlamaAttention", {"__init__:no_such"})])
    planted = tmp_path / "m.py"
    planted.write_text(
        "from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager\n"
        "class M(SlidingWindowManager):\n"
        "    def f(self):\n"
        "        return super().get_num_blocks_to_allocate(no_such=1)\n")
    problems = subclass_problems(reference, reference, vllm_subclasses(tmp_path))
    assert len(problems) == 1 and "get_num_blocks_to_allocate(no_such=...)" in problems[0]


def test_a_changed_vllm_module_is_reported(reference, tmp_path):
    """In a release whose ``SlidingWindowManager`` has lost a method the
    exact-token manager overrides, changed the parameters of another and
    renamed an attribute it reads, the subclass check reports all three; a
    private method ``compat.py`` calls with another parameter is reported by
    the private-name check."""
    module = "vllm.v1.core.single_type_kv_cache_manager"
    fake = tmp_path / "vllm" / "v1" / "core"
    fake.mkdir(parents=True)
    source = reference.path(module).read_text()
    for old, new in (("def remove_skipped_blocks(", "def remove_skipped_blocks_renamed("),
                     ("def add_local_computed_blocks(\n        self,",
                      "def add_local_computed_blocks(\n        self, new_first,"),
                     ("self.enable_caching", "self.caching_enabled"),
                     ("def _remove_blocks_in_range(\n        self,",
                      "def _remove_blocks_in_range(\n        self, group,")):
        assert old in source, old
        source = source.replace(old, new)
    (fake / "single_type_kv_cache_manager.py").write_text(source)
    release = Release(tmp_path, "fake")
    classes = [c for c in vllm_subclasses() if c.name == "ExactTokensManager"]
    problems = subclass_problems(release, reference, classes)
    assert len(problems) == 3, problems
    assert "remove_skipped_blocks overrides a member its vLLM bases no longer have" \
        in problems[0]
    assert "add_local_computed_blocks overrides (self, new_first, request_id" in problems[1]
    assert "reads self.enable_caching" in problems[2]
    assert private_problems(release, reference, {"_remove_blocks_in_range",
                                                 "_get_num_evictable_blocks"}) == [
        "_remove_blocks_in_range in vllm.v1.core.single_type_kv_cache_manager: "
        f"['(self, group, request_id, first_block, last_block)'] in {release}, "
        f"['(self, request_id, first_block, last_block)'] in {reference}"]


def test_only_compat_touches_vllm_private_names(reference):
    """Every vLLM internal the plugin uses goes through ``compat.py``: no other
    module reads, calls or imports a private name that vLLM defines (and this
    package does not define itself; :data:`OTHER_LIBRARIES` aside)."""
    theirs = set(reference.private_names) - our_private_names() - set(OTHER_LIBRARIES)
    found = [f"{path.relative_to(OURS)}:{line}: {name}"
             for path in sorted(OURS.rglob("*.py")) if path.name != "compat.py"
             for line, name in _private_uses(path) if name in theirs]
    assert not found, "vLLM private names outside compat.py:\n" + "\n".join(found)


def test_the_private_name_check_sees_a_use(tmp_path):
    """The scan finds a planted call of a vLLM private method."""
    planted = tmp_path / "m.py"
    planted.write_text("def f(m):\n    return m._remove_blocks_in_range(1, 2, 3)\n")
    assert _private_uses(planted) == [(2, "_remove_blocks_in_range")]
