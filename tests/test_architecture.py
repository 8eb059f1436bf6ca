"""The package's layers and who may import whom (docs/architecture.md), enforced.

Every import in every module counts, including imports inside functions and under
``TYPE_CHECKING``: a harness module that the engine imports lazily is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "xavier_async"

#: module (dotted, relative to the package) -> layer
LAYERS = {
    "core": ["errors", "_checks", "sizes", "policy", "lifecycle", "config", "layout", "planning",
             "merging", "protocol", "decision", "snapshot_index", "retry", "metrics", "stages", "diagram"],
    "shell": ["shielded", "slabs", "fairpool", "recvslabs", "tasks", "packing", "_triton_runs",
              "channel", "copythreads", "hostcopy", "runtime", "peers", "snapshots", "scheduling", "receiver", "source", "endpoint",
              "_internal", "__init__"],
    "transports": ["transports"],
    "testing": ["testing"],
    "vllm": ["vllm"],
    "bench": ["bench"],
    "demo": ["demo"],
}

#: layer -> the layers it may import (its own included)
ALLOWED = {
    "core": {"core"},
    "shell": {"core", "shell", "transports"},
    "transports": {"core", "transports"},
    "testing": {"core", "shell", "transports", "testing"},
    "vllm": {"core", "shell", "transports", "vllm"},
    "bench": {"core", "shell", "transports", "testing", "vllm", "bench", "demo"},  # the CLI hosts `demo`
    "demo": {"core", "shell", "transports", "testing", "demo"},
}
#: the shell modules a transport may name (for types only: slabs are what it registers)
SHELL_TYPES = {"slabs"}
#: third-party modules the pure core must not import (no event loop, no transport)
NOT_IN_CORE = {"anyio", "nixl", "trio", "asyncio", "socket"}
#: the vLLM connector's pure modules (hypothesis drives them without vLLM or a loop)
VLLM_PURE = {"vllm.directory", "vllm.scheduler", "vllm.metadata", "vllm.settings"}


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    for layer, mods in LAYERS.items():
        if top in mods:
            return layer
    raise AssertionError(f"module {module!r} belongs to no layer: add it to docs/architecture.md "
                         f"and to LAYERS here")


def modules() -> list[tuple[str, Path]]:
    """``(dotted name relative to the package, path)``; a package's ``__init__`` is the
    package's own name (the root's is ``__init__``)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def imports_of(path: Path) -> list[str]:
    """Every module imported anywhere in a file, as absolute dotted names."""
    rel = path.relative_to(PKG.parent).with_suffix("").parts
    package = list(rel[:-1])  # the package this file belongs to (for an __init__, itself)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append(node.module or "")
                continue
            base = package[: len(package) - node.level + 1]
            if node.module:
                found.append(".".join([*base, node.module]))
            else:  # from . import a, b: each name is a module or a member of the package
                found.extend(".".join([*base, a.name]) for a in node.names)
    return found


def internal(mod: str) -> str | None:
    """The package-relative module an import of ours names (``None`` for third-party ones);
    ``from pkg import name`` where ``name`` is not a module names ``pkg``."""
    if mod != "xavier_async" and not mod.startswith("xavier_async."):
        return None
    rel = mod.removeprefix("xavier_async").removeprefix(".")
    while rel and rel not in NAMES:
        rel = rel.rpartition(".")[0]
    return rel or "__init__"


ALL = modules()
NAMES = {n for n, _ in ALL}


@pytest.mark.parametrize("name,path", ALL, ids=[n for n, _ in ALL])
def test_module_imports_follow_the_layers(name, path):
    mine = layer_of(name)
    for mod in imports_of(path):
        target = internal(mod)
        if target is None:
            if mine == "core":
                assert mod.split(".")[0] not in NOT_IN_CORE, f"{name} (pure core) imports {mod}"
            continue
        theirs = layer_of(target)
        if mine == "transports" and theirs == "shell" and target in SHELL_TYPES:
            continue
        assert theirs in ALLOWED[mine], f"{name} ({mine}) imports {target} ({theirs})"


def test_the_import_reader_sees_relative_imports():
    """A guard on the checker itself: relative imports resolve to our modules."""
    seen = {internal(m) for _, p in ALL for m in imports_of(p)} - {None}
    assert {"endpoint", "protocol", "transports.base", "testing.peer_process", "policy"} <= seen
    names = {n for n, _ in ALL}
    assert {"endpoint", "bench.suite", "testing.faulty", "transports.nixl", "__init__"} <= names


def test_the_engine_imports_nothing_from_the_harness():
    for name, path in ALL:
        if layer_of(name) not in ("core", "shell", "transports"):
            continue
        for mod in imports_of(path):
            target = internal(mod) or ""
            assert target.split(".")[0] not in ("testing", "bench", "demo", "vllm"), \
                f"{name} imports {mod}"


def test_the_vllm_connector_s_planning_is_pure():
    """The directory, the scheduler's planning, the step plan and the settings import
    neither vLLM nor an event loop, a socket, a thread or NIXL, and only the pure core of
    the engine."""
    for name, path in ALL:
        if name not in VLLM_PURE:
            continue
        for mod in imports_of(path):
            target = internal(mod)
            if target is None:
                assert mod.split(".")[0] not in NOT_IN_CORE | {"vllm", "threading", "torch"}, \
                    f"{name} imports {mod}"
            else:
                assert target in VLLM_PURE or layer_of(target) == "core", f"{name} imports {target}"
    assert VLLM_PURE <= NAMES


def test_the_architecture_page_lists_every_layer_and_module():
    page = (PKG.parent / "docs" / "architecture.md").read_text()
    for mods in LAYERS.values():
        for mod in mods:
            if mod != "__init__":
                assert f"`{mod}" in page, f"docs/architecture.md does not mention {mod}"


def test_the_engine_guards_no_runtime_state_with_assert():
    """A broken invariant in the engine raises a typed error (``InternalError`` or the
    caller's error), never ``AssertionError`` (which ``python -O`` would also strip):
    there is no ``assert`` statement in the pure core, the shell or the transports."""
    found = []
    for name, path in ALL:
        if layer_of(name) not in ("core", "shell", "transports"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not found, f"assert statements in the engine: {found}"


def test_every_background_task_of_the_engine_is_guarded():
    """Tasks start only through the endpoint's guarded ``Tasks`` (``tasks.py``): outside it,
    the engine calls ``start_soon`` only on a ``Tasks``/``TaskSpawner`` it was handed
    (``self._tg`` of the endpoint, ``tasks``/``self._tasks`` of a transport), or on
    ``batches``, the task group of one load's batches (``Receiver._pipelined``: its tasks
    end before the load returns and catch everything but a cancellation)."""
    allowed = {"_tg", "tasks", "_tasks", "batches"}
    bad = []
    for name, path in ALL:
        if layer_of(name) not in ("core", "shell", "transports") or name == "tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "start_soon":
                owner = node.func.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "?")
                if owner_name not in allowed:
                    bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} ({owner_name}.start_soon)")
    assert not bad, f"background tasks started outside the guard: {bad}"


def test_the_package_imports_without_cycles():
    """No module of the package (engine, test support, demo and bench) reaches itself
    through its imports (any import counts, lazy or for types); the transports' modules
    included (``nixl`` wires ``peering``, ``admission``, ``liveness``, ``nixl_copies``,
    ``nixl_memory``, none of which imports it back), and the bench's sections (they share
    ``bench.common``; the suite imports the other sections, none of which imports it back)."""
    graph = {name: {t for m in imports_of(path) if (t := internal(m)) is not None and t != name}
             for name, path in ALL}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, cycles
    assert {"transports.peering", "transports.admission", "transports.liveness",
            "transports.nixl_agent", "transports.addresses", "transports.nixl_copies",
            "transports.nixl_memory"} <= graph["transports.nixl"]
    # the checker sees the bench's lazy imports (the suite starts the other sections)
    assert {"bench.descriptors", "bench.serving", "bench.xoscar_anchor", "bench.common"} <= graph["bench.suite"]
