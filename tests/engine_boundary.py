"""The engine boundary, read from the source: which parts of hivemind are its public API, and which uses of
hivemind outside agora_client/engine/ reach past it. The rule is written in tests/test_engine_contract.py.

Names are told apart by what they refer to, not by how they are spelled: an import is resolved to the object
it binds, and an attribute access to the class that defines the attribute (through the receiver's class and
its bases); only a receiver whose class cannot be read from the source falls back to the attribute's name.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import importlib
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hivemind

HIVEMIND = Path(hivemind.__file__).parent
REPO = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("agora_client", "tui")


@dataclass(frozen=True)
class Page:
    """One class or function on hivemind 1.1.12's API pages (docs/modules/*.rst): ``members``, the members an
    explicit ``:members: a, b`` list shows (None: ``:members:`` shows them all); ``exclude``: ``:exclude-members:``."""

    path: str
    members: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()


DOCUMENTED = (
    # docs/modules/dht.rst
    Page("hivemind.dht.DHT", exclude=("make_key",)),
    Page("hivemind.dht.DHTNode"),
    Page("hivemind.dht.protocol.DHTProtocol"),
    Page("hivemind.dht.routing.RoutingTable"),
    Page("hivemind.dht.routing.KBucket"),
    Page("hivemind.dht.routing.DHTID", exclude=("HASH_FUNC",)),
    Page("hivemind.dht.traverse.simple_traverse_dht"),
    Page("hivemind.dht.traverse.traverse_dht"),
    # docs/modules/server.rst
    Page("hivemind.moe.server.Server"),
    Page("hivemind.moe.server.ModuleBackend", ("forward", "backward", "on_backward", "get_info", "get_pools")),
    Page("hivemind.moe.server.runtime.Runtime"),
    Page(
        "hivemind.moe.server.task_pool.TaskPool",
        (
            "submit_task",
            "iterate_minibatches",
            "load_batch_to_runtime",
            "send_outputs_from_runtime",
            "get_task_size",
            "empty",
        ),
    ),
    # docs/modules/averaging.rst
    Page(
        "hivemind.averaging.DecentralizedAverager",
        exclude=(
            "get_tensors",
            "get_tensors_async",
            "update_tensors",
            "rpc_join_group",
            "rpc_aggregate_part",
            "register_allreduce_group",
        ),
    ),
    # docs/modules/client.rst
    Page("hivemind.moe.client.RemoteExpert", ("forward",)),
    Page("hivemind.moe.client.RemoteMixtureOfExperts"),
    Page("hivemind.moe.client.RemoteSwitchMixtureOfExperts"),
    # docs/modules/optim.rst
    Page(
        "hivemind.optim.optimizer.Optimizer",
        ("step", "local_epoch", "zero_grad", "load_state_from_peers", "param_groups", "shutdown"),
    ),
    Page("hivemind.optim.grad_scaler.GradScaler"),
    # docs/user/dht.md
    Page("hivemind.utils.networking.choose_ip_address"),
)

# The seams /work/shared/DESIGN.md builds on ("Build on the engine, do not fork it") that neither an __init__ nor an
# API page exports; their members follow the ``:members:`` rule.
DESIGN_SEAMS = (
    "hivemind.moe.server.connection_handler.ConnectionHandler",
    "hivemind.optim.progress_tracker.ProgressTracker",
    "hivemind.utils.auth.TokenAuthorizerBase",
)


def _resolve_path(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def hivemind_module(obj: object) -> str | None:
    """The hivemind module that defines ``obj``, or None: not hivemind's. (protoc names its messages' module
    ``runtime_pb2``, not ``hivemind.proto.runtime_pb2``: those are told by the .proto file they come from.)"""
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if isinstance(module, str) and module.split(".")[0] == "hivemind":
        return module
    proto_file = getattr(getattr(getattr(obj, "DESCRIPTOR", None), "file", None), "name", None)
    if isinstance(proto_file, str) and proto_file.endswith(".proto"):
        candidate = f"hivemind.proto.{proto_file.removesuffix('.proto')}_pb2"
        if getattr(sys.modules.get(candidate), "DESCRIPTOR", None) is obj.DESCRIPTOR.file:
            return candidate
    return None


def _is_hivemind(obj: object) -> bool:
    return hivemind_module(obj) is not None


@functools.cache
def _class_source(cls: type) -> tuple[list[str], ast.Module] | None:
    """``cls``'s source lines and their syntax tree (read once: the checks ask for them per member)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
        return lines, ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, IndentationError):
        return None


@functools.lru_cache(maxsize=None)
def parse_source(text: str, filename: str) -> ast.Module:
    """A file's syntax tree, parsed once per content (both passes over the project read every file)."""
    return ast.parse(text, filename)


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """The attributes ``cls``'s own methods set on ``self``."""
    source = _class_source(cls)
    if source is None:
        return frozenset()
    tree = source[1]
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _defines(cls: type, name: str) -> bool:
    return name in vars(cls) or name in _instance_attributes(cls)


def _data_attribute_is_documented(cls: type, name: str) -> bool:
    """Whether a class-level data attribute carries a doc-comment (``#:`` above it or a string below it): the
    only way autodoc renders one."""
    source = _class_source(cls)
    if source is None:
        return False
    lines, tree = source
    body = tree.body[0].body
    for index, statement in enumerate(body):
        targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            after = body[index + 1] if index + 1 < len(body) else None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return True
            return lines[statement.lineno - 2].strip().startswith("#:") if statement.lineno > 1 else False
    return False


class PublicApi:
    """hivemind's public API: the objects its package ``__init__`` files export, the classes and functions its
    API pages document, DESIGN's seams and the types their signatures take; and, of a public class, the members
    its page shows (see ``is_public_member``)."""

    def __init__(self) -> None:
        self.pages = {id(_resolve_path(page.path)): page for page in DOCUMENTED}
        roots = [*self._exported(), *(_resolve_path(page.path) for page in DOCUMENTED)]
        roots += [_resolve_path(path) for path in DESIGN_SEAMS]
        self.objects: dict[int, object] = {}
        for obj in roots:
            self.objects[id(obj)] = obj
        pending = list(roots)
        while pending:  # a type a public signature or a public attribute holds is public: a caller meets it
            for found in self._signature_types(pending.pop()):
                if id(found) not in self.objects and _is_hivemind(found):
                    self.objects[id(found)] = found
                    pending.append(found)
        self.modules = {obj.__name__ for obj in self.objects.values() if isinstance(obj, types.ModuleType)}
        self.modules |= {hivemind_module(obj) for obj in self.objects.values()}

    @staticmethod
    def _exported() -> Iterator[object]:
        for init in HIVEMIND.rglob("__init__.py"):
            package_name = ".".join(init.parent.relative_to(HIVEMIND.parent).parts)
            package = importlib.import_module(package_name)
            yield package
            for node in ast.parse(init.read_text()).body:
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if hasattr(package, alias.asname or alias.name):
                            yield getattr(package, alias.asname or alias.name)

    def _signature_types(self, obj: object) -> Iterator[object]:
        if isinstance(obj, type):
            callables = [getattr(obj, name, None) for name in dir(obj) if self.is_public_member(obj, name)]
        elif callable(obj):
            callables = [obj]
        else:
            return
        if isinstance(obj, type):
            callables += [
                _attribute_source(obj, name) for name in _instance_attributes(obj) if self.is_public_member(obj, name)
            ]
        for function in callables:
            if isinstance(function, property):
                function = function.fget
            if not callable(function):
                continue
            try:
                hints = typing.get_type_hints(function)
            except Exception:  # an annotation hivemind never made resolvable: nothing to learn from it
                hints = {}
            for key, hint in hints.items():
                if key == "return" or not isinstance(function, _AttributeSource):
                    yield from _types_in(hint)

    def is_public(self, obj: object) -> bool:
        return id(obj) in self.objects or (isinstance(obj, types.ModuleType) and obj.__name__ in self.modules)

    def is_public_member(self, cls: type, name: str) -> bool:
        """Whether ``name`` is part of public class ``cls``'s API: it is what its page lists, or else a name with no
        leading underscore that the page does not exclude, save a class-level data attribute without a doc-comment
        (autodoc leaves those off every page; hivemind keeps its serializers and reserved constants that way)."""
        page = self.pages.get(id(cls))
        if name == "__init__":
            return True
        if name.startswith("_") or (page is not None and name in page.exclude):
            return False
        defining = next((base for base in cls.__mro__ if _defines(base, name)), None)
        if defining is None:
            return False
        value = vars(defining).get(name)
        is_method = inspect.isroutine(value) or isinstance(value, (property, classmethod, staticmethod))
        if is_method and page is not None and page.members is not None:
            return name in page.members
        is_field = name in getattr(defining, "__dataclass_fields__", ()) or name in getattr(defining, "_fields", ())
        is_own_class = isinstance(value, type) and value.__qualname__.startswith(f"{defining.__qualname__}.")
        if name not in vars(defining) or is_method or is_field or is_own_class or isinstance(value, enum.Enum):
            return True
        return _data_attribute_is_documented(defining, name)

    def member_is_public(self, cls: type, name: str) -> bool:
        """Whether ``cls.name`` (``cls`` a hivemind class or a subclass of one) reaches only the public API."""
        defining = next((base for base in cls.__mro__ if _defines(base, name)), None)
        if defining is None or not _is_hivemind(defining):
            return True  # not hivemind's: the project's own, Python's, torch's
        return any(
            self.is_public(base) and issubclass(base, defining) and self.is_public_member(base, name)
            for base in cls.__mro__
        )

    @functools.cached_property
    def internal_names(self) -> frozenset[str]:
        """Every name hivemind defines (functions, classes, class and instance attributes, module globals) that
        no part of its public API carries."""
        defined = set()
        for path in HIVEMIND.rglob("*.py"):
            defined |= attribute_names(parse_source(path.read_text(), str(path)))
        public = {getattr(obj, "__name__", None) for obj in self.objects.values()}
        for obj in self.objects.values():
            if isinstance(obj, type):
                public |= {
                    name for base in obj.__mro__ for name in _member_names(base) if self.is_public_member(obj, name)
                }
        return frozenset(name for name in defined - public if not (name.startswith("__") and name.endswith("__")))


class _AttributeSource:
    """What an instance attribute of a hivemind class is set from, as a callable whose return hint is its type
    (``self.global_progress = self._parse_swarm_progress_data(...)``)."""

    def __init__(self, function: object) -> None:
        self.__annotations__ = {"return": typing.get_type_hints(function).get("return")} if function else {}
        self.__globals__ = getattr(function, "__globals__", {})

    def __call__(self) -> None: ...


def _attribute_source(cls: type, name: str) -> _AttributeSource:
    """The function whose call ``cls``'s source assigns to ``self.<name>``, if any (its return hint is the type)."""
    source = _class_source(cls)
    if source is None:
        return _AttributeSource(None)
    for node in ast.walk(source[1]):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and any(_is_self_attribute(target) and target.attr == name for target in node.targets)
        ):
            function = node.value.func
            if _is_self_attribute(function):
                found = getattr(cls, function.attr, None)
            elif isinstance(function, ast.Name):
                found = vars(sys.modules[cls.__module__]).get(function.id)
            else:
                continue
            found = getattr(found, "__func__", found)
            if inspect.isfunction(found):
                try:
                    return _AttributeSource(found)
                except Exception:  # a hint hivemind never made resolvable
                    continue
    return _AttributeSource(None)


def _types_in(hint: object) -> Iterator[object]:
    if isinstance(hint, type) or hasattr(hint, "DESCRIPTOR"):  # a class, or a protobuf enum
        yield hint
    for argument in typing.get_args(hint):
        yield from _types_in(argument)


def _member_names(cls: type) -> set[str]:
    return set(vars(cls)) | _instance_attributes(cls)


def attribute_names(tree: ast.Module) -> set[str]:
    """The names a module defines that an attribute access can reach: functions, classes, attributes set on
    anything, and the names its module and class bodies bind (a function's local variables are no attributes)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for statement in node.body:
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
                )
                names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


@functools.cache
def public_api() -> PublicApi:
    return PublicApi()


# --- reading the project's source


@dataclass
class StaticClass:
    """A class of the file being read: its bases (runtime classes or other StaticClasses), what it defines."""

    node: ast.ClassDef
    bases: list[object]
    methods: dict[str, int] = field(default_factory=dict)  # name -> line, class-body assignments included
    stores: dict[str, int] = field(default_factory=dict)  # self.<name> = ... -> line
    attribute_types: dict[str, object] = field(default_factory=dict)  # self.<name> -> the class it holds

    def chain(self) -> list[object]:
        """The class and its bases in lookup order (a simplified MRO: depth first, each class once)."""
        order: list[object] = [self]
        for base in self.bases:
            for cls in base.chain() if isinstance(base, StaticClass) else getattr(base, "__mro__", ()):
                if not any(cls is seen for seen in order):
                    order.append(cls)
        return order

    def defines(self, name: str) -> bool:
        return name in self.methods or name in self.stores


@dataclass(frozen=True)
class Instance:
    cls: object  # a runtime class or a StaticClass


def _defining(chain: list[object], name: str) -> object | None:
    for cls in chain:
        if cls.defines(name) if isinstance(cls, StaticClass) else isinstance(cls, type) and _defines(cls, name):
            return cls
    return None


def _member_is_public(api: PublicApi, chain: list[object], name: str) -> bool:
    defining = _defining(chain, name)
    if defining is None or isinstance(defining, StaticClass) or not _is_hivemind(defining):
        return True
    return any(
        isinstance(cls, type) and api.is_public(cls) and issubclass(cls, defining) and api.is_public_member(cls, name)
        for cls in chain
    )


def _chain_of(value: object) -> list[object] | None:
    cls = value.cls if isinstance(value, Instance) else value
    if isinstance(cls, StaticClass):
        return cls.chain()
    return list(cls.__mro__) if isinstance(cls, type) else None


def _qualname(cls: object) -> str:
    return cls.node.name if isinstance(cls, StaticClass) else getattr(cls, "__qualname__", repr(cls))


class ModuleReader:
    """Resolves what the names and attribute accesses of one source file refer to, and reports each one that
    reaches past hivemind's public API."""

    def __init__(self, path: Path, api: PublicApi, project_names: frozenset[str]) -> None:
        self.path, self.api, self.project_names = path, api, project_names
        self.tree = parse_source(path.read_text(), str(path))
        self.package = _package_of(path)
        self.globals: dict[str, object] = {}
        self.imports: list[tuple[ast.AST, str, str | None]] = []  # (node, module, name or None)
        self.classes: dict[ast.ClassDef, StaticClass] = {}
        self.violations: list[str] = []
        self._read_imports()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                self._read_class(node)

    def where(self, node: ast.AST) -> str:
        return f"{_relative(self.path)}:{node.lineno}"

    # imports bind names to the objects they import (wherever in the file the import stands)

    def _read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    self.imports.append((node, alias.name, None))
                    self.globals[alias.asname or top] = _Lazy(alias.name if alias.asname else top, None)
            elif isinstance(node, ast.ImportFrom):
                module = self._absolute(node)
                for alias in node.names:
                    self.imports.append((node, module, alias.name))
                    self.globals[alias.asname or alias.name] = _Lazy(module, alias.name)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def _read_class(self, node: ast.ClassDef) -> None:
        static = StaticClass(node, [])
        self.classes[node] = static
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                static.methods[statement.name] = statement.lineno
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        static.methods[target.id] = statement.lineno
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    static.attribute_types[statement.target.id] = statement.annotation
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Assign, ast.AnnAssign)):
                for target in inner.targets if isinstance(inner, ast.Assign) else [inner.target]:
                    if _is_self_attribute(target):
                        static.stores.setdefault(target.attr, target.lineno)
                        typed = inner.annotation if isinstance(inner, ast.AnnAssign) else inner.value
                        static.attribute_types.setdefault(target.attr, typed)

    def _bases(self, static: StaticClass) -> list[object]:
        if not static.bases and static.node.bases:
            static.bases = [base for base in map(self._class_of, static.node.bases) if base is not None]
        return static.bases

    # resolving expressions: a runtime object, an Instance of a class, a StaticClass, or None (unknown)

    def _class_of(self, expression: ast.AST, scope: dict[str, object] | None = None) -> object | None:
        value = self.resolve(expression, scope or {})
        if isinstance(value, StaticClass) or isinstance(value, type):
            return value
        return None

    def resolve(self, node: ast.AST, scope: dict[str, object]) -> object | None:
        if isinstance(node, ast.Name):
            value = scope[node.id] if node.id in scope else self.globals.get(node.id)
            if value is None and node.id in vars(builtins):
                return vars(builtins)[node.id]
            return value.load() if isinstance(value, _Lazy) else value
        if isinstance(node, ast.Attribute):
            receiver = self.resolve(node.value, scope)
            if isinstance(receiver, Instance) and isinstance(receiver.cls, StaticClass):
                hint = receiver.cls.attribute_types.get(node.attr)
                return self._instance_from(hint, scope) if hint is not None else None
            if receiver is None or isinstance(receiver, (Instance, StaticClass)):
                return None
            return getattr(receiver, node.attr, None)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
            try:
                return self.resolve(ast.parse(node.value, mode="eval").body, scope)
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript):  # Optional[X], list[X]: what it holds is not read
            return None
        return None

    def _instance_from(self, expression: ast.AST, scope: dict[str, object]) -> Instance | None:
        """What an annotation or an assigned value makes of a name: an Instance when it names or calls a class."""
        if isinstance(expression, ast.Call):
            expression = expression.func
        cls = self._class_of(expression, scope)
        return Instance(cls) if cls is not None else None

    # the walk

    def check(self) -> list[str]:
        for node, module, name in self.imports:
            self._check_import(node, module, name)
        for static in self.classes.values():
            self._bases(static)
        for node in self.tree.body:
            self._visit(node, {}, None)
        return self.violations

    def _visit(self, node: ast.AST, scope: dict[str, object], owner: StaticClass | None) -> None:
        if isinstance(node, ast.ClassDef):
            for child in [*node.bases, *node.decorator_list, *node.body]:
                self._visit(child, scope, self.classes[node])
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = dict(scope)
            inner.update(self._function_scope(node, owner))
            for child in ast.iter_child_nodes(node):
                self._visit(child, inner, None)
            return
        if isinstance(node, ast.Attribute):
            self._check_attribute(node, scope)
        for child in ast.iter_child_nodes(node):
            self._visit(child, scope, owner)

    def _function_scope(self, node: ast.AST, owner: StaticClass | None) -> dict[str, object]:
        scope: dict[str, object] = {}
        arguments = node.args
        positional = [*arguments.posonlyargs, *arguments.args]
        for argument in [*positional, *arguments.kwonlyargs]:
            if argument.annotation is not None:
                scope[argument.arg] = self._instance_from(argument.annotation, {})
            else:
                scope[argument.arg] = None  # a parameter shadows a global of the same name
        if owner is not None and positional and not isinstance(node, ast.Lambda):
            decorators = {ast.unparse(decorator) for decorator in node.decorator_list}
            if "staticmethod" not in decorators:
                scope[positional[0].arg] = owner if "classmethod" in decorators else Instance(owner)
        if isinstance(node, ast.Lambda):
            return scope
        for statement in ast.walk(node):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                scope[statement.target.id] = self._instance_from(statement.annotation, scope)
            elif isinstance(statement, ast.Assign):
                for target in statement.targets:
                    if isinstance(target, ast.Name):
                        scope[target.id] = self._instance_from(statement.value, scope)
        return scope

    # the checks

    def _check_import(self, node: ast.AST, module: str, name: str | None) -> None:
        if module.split(".")[0] != "hivemind":
            return
        value = _Lazy(module, name).load()
        if value is None or not self.api.is_public(value):
            self.violations.append(f"{self.where(node)} imports {module}{'.' + name if name else ''}")

    def _check_attribute(self, node: ast.Attribute, scope: dict[str, object]) -> None:
        if node.attr.startswith("__") and node.attr.endswith("__"):
            return
        receiver = self.resolve(node.value, scope)
        if isinstance(receiver, types.ModuleType):
            value = getattr(receiver, node.attr, None)
            if _is_hivemind(receiver) and value is not None and not self.api.is_public(value):
                self.violations.append(f"{self.where(node)} {receiver.__name__}.{node.attr}")
            return
        chain = _chain_of(receiver) if receiver is not None else None
        if isinstance(receiver, StaticClass) or isinstance(getattr(receiver, "cls", None), StaticClass):
            for static in chain:
                if isinstance(static, StaticClass):
                    self._bases(static)
            chain = _chain_of(receiver)
        if chain is not None:
            if not _member_is_public(self.api, chain, node.attr):
                defining = _defining(chain, node.attr)
                self.violations.append(f"{self.where(node)} {_qualname(defining)}.{node.attr}")
            return
        if (
            receiver is None
            and node.attr.startswith("_")
            and node.attr in self.api.internal_names
            and node.attr not in self.project_names
        ):
            self.violations.append(f"{self.where(node)} .{node.attr} (a name only hivemind defines)")

    def overrides(self) -> list[str]:
        """Each member a class of this file defines (a method, a class attribute, or ``self.<name> =``) over one a
        hivemind base class defines, unless it is a public hook of that base."""
        found = []
        for static in self.classes.values():
            chain = [static, *static.chain()[1:]] if self._bases(static) is not None else [static]
            hivemind_bases = [cls for cls in chain[1:] if isinstance(cls, type) and _is_hivemind(cls)]
            if not hivemind_bases:
                continue
            for name, line in [*static.methods.items(), *static.stores.items()]:
                upstream = _defining(chain[1:], name)
                if upstream is None or not isinstance(upstream, type) or not _is_hivemind(upstream):
                    continue
                if not _member_is_public(self.api, chain[1:], name):
                    found.append(
                        f"{_relative(self.path)}:{line} {static.node.name}.{name} "
                        f"overrides {_qualname(upstream)}.{name}"
                    )
        return found


@dataclass(frozen=True)
class _Lazy:
    """An imported name, imported only when something reads it."""

    module: str
    name: str | None

    def load(self) -> object | None:
        try:
            module = importlib.import_module(self.module)
        except Exception:  # optional or platform-only imports: nothing to resolve through them
            return None
        if self.name is None:
            return module
        if hasattr(module, self.name):
            return getattr(module, self.name)
        try:
            return importlib.import_module(f"{self.module}.{self.name}")
        except Exception:
            return None


def _is_self_attribute(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _package_of(path: Path) -> str:
    try:
        parts = list(path.resolve().relative_to(REPO).with_suffix("").parts)
    except ValueError:
        return ""
    return ".".join(parts[:-1])


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# --- the project


def project_files() -> list[Path]:
    return sorted(path for package in PROJECT_PACKAGES for path in (REPO / package).rglob("*.py")) + [
        REPO / "agora_cli.py"
    ]


def outside_engine(paths: list[Path]) -> list[Path]:
    return [path for path in paths if "engine" not in path.relative_to(REPO).parts]


@functools.cache
def project_names() -> frozenset[str]:
    """The attribute names the project's own code defines (engine/ included), less those it defines over a
    hivemind class's member: an override is hivemind's name, not the project's."""
    api = public_api()
    names: set[str] = set()
    for path in project_files():
        reader = ModuleReader(path, api, frozenset())
        names |= attribute_names(reader.tree)
        for static in reader.classes.values():
            reader._bases(static)
            upstream = [cls for cls in static.chain()[1:] if isinstance(cls, type) and _is_hivemind(cls)]
            names -= {
                name for name in [*static.methods, *static.stores] if any(_defines(cls, name) for cls in upstream)
            }
    return frozenset(names)


def boundary_violations(paths: list[Path]) -> list[str]:
    """Every use in ``paths`` of a hivemind internal: an import, an attribute access, an override."""
    api, names = public_api(), project_names()
    violations = []
    for path in paths:
        reader = ModuleReader(path, api, names)
        violations += reader.check() + reader.overrides()
    return violations
