"""Where the engine's code may reach (docs/architecture.md, "The engine's parts"): read from the source with ast,
so a new import that breaks a rule fails here, not in a reader's head.

- lora_compile imports nothing from the service, the demo, the benchmarks or the tests, and the service's doors
  (gRPC, HTTP), telemetry and SDK import nothing of lora_compile (they reach it through the runner and the front);
- the doors import nothing of the runner either: only the request front (service/front/), the server that wires
  them, telemetry and the CLI do;
- no import cycle among its modules (imports inside functions count; `if TYPE_CHECKING:` ones, for annotations
  only, do not);
- its sub-packages import downwards only: `model/` (families, layers, attention, loaders, weight forms),
  `kv_cache/` and `sample/` (sampling, logits processors, grammars) reach none of the others; `lora/` reaches
  `model/` and `kv_cache/`; `core/` (the engine, the step, batch init, CUDA graphs) may reach all of them; and
  no module outside `core/` imports it, but the package's front door (`lora_compile/__init__.py`)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "lora_compile"
OUTSIDE = ("service", "lora_serve_demo", "benchmarks", "tests")
# Sub-package -> the sub-packages it may import (the root modules: config, errors, sequence... are open to all).
MAY_IMPORT = {
    "model": {"model"},
    "kv_cache": {"kv_cache"},
    "sample": {"sample"},
    "lora": {"lora", "model", "kv_cache"},
    "core": {"core", "model", "kv_cache", "sample", "lora"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ENGINE.rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict[str, Path], annotations: bool = False) -> set[str]:
    """The modules `name` imports when it runs (any depth in the file, TYPE_CHECKING blocks left out unless
    `annotations`)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node) and not annotations:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import x` imports the module x where there is one
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _part(module: str) -> str | None:
    """The sub-package a module of the engine belongs to; None for the root modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def test_the_engine_imports_nothing_from_the_service_the_demo_benchmarks_or_tests():
    bad = [f"{m} imports {t}" for m, targets in _graph().items() for t in targets
           if t.split(".")[0] in OUTSIDE]
    assert not bad, "the engine reaches outside itself:\n" + "\n".join(sorted(bad))


def test_no_import_cycles_in_the_engine():
    graph = {m: {t for t in targets if t in _modules()} for m, targets in _graph().items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if t == m or _is_package_of(t, m):
                continue  # a module importing its own package's __init__ (or itself) is not a cycle of ours
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                walk(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".") and (ENGINE.parent / package.replace(".", "/") / "__init__.py").exists()


def test_sub_packages_import_downwards_only():
    bad = []
    for m, targets in _graph().items():
        part = _part(m)
        for t in targets:
            if not t.startswith("lora_compile."):
                continue
            target_part = _part(t)
            if target_part == "core" and part != "core" and m != "lora_compile":
                bad.append(f"{m} imports {t}: only core/ and the package's front door reach core/")
            elif part is not None and target_part is not None and target_part not in MAY_IMPORT[part]:
                bad.append(f"{m} imports {t}: {part}/ may reach only {sorted(MAY_IMPORT[part])}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_the_rules_see_the_imports_they_judge():
    """The reader behind the rules finds what it must: a relative import two levels up, a module imported with
    `from . import`, one inside a function, and none from a TYPE_CHECKING block."""
    graph = _graph()
    assert "lora_compile.config" in graph["lora_compile.model.loader.source"]
    assert "lora_compile.core.compiled_stack" in graph["lora_compile.core.engine"]
    assert "lora_compile.model.attention_sdpa" in graph["lora_compile.model.forward_batch"]  # inside a function
    assert "lora_compile.sequence" not in graph["lora_compile.sample.sampling"]  # annotations only


# The service's parts that must not reach the engine but through service/runner/ (its only holder), the request
# front (service/front/) and the shared error mapping (service/errors.py): the two doors, telemetry, the SDK.
DOORS = ("service/grpc_api", "service/http_api", "service/telemetry", "service/client")
# Who may import the runner (service/runner/): the request front (both doors' one way to it, whose package hands
# the doors the runner's types they read), the process that wires runner, front and doors (service/server.py),
# telemetry (it observes the runner's requests and steps) and the CLI (the engine thread). Not the doors.
RUNNER_HOLDERS = ("service.front", "service.server", "service.telemetry", "service.cli", "service.cli_vllm")


def test_the_doors_reach_the_engine_only_through_the_runner_and_the_front():
    bad = []
    for folder in DOORS:
        for path in (ROOT / folder).rglob("*.py"):
            name = _module_name(path)
            bad += [f"{name} imports {t}" for t in _imports(path, name, {}) if t.split(".")[0] == "lora_compile"]
    assert not bad, "a door reaches the engine directly:\n" + "\n".join(sorted(bad))


def test_only_the_front_the_server_telemetry_and_the_cli_import_the_runner():
    """So the HTTP and the gRPC walks visit the same front files after their own parsing: a door that asked the
    runner itself (even for a type in an annotation) would have a path of its own."""
    bad = []
    for path in (ROOT / "service").rglob("*.py"):
        name = _module_name(path)
        if _within(name, ("service.runner", *RUNNER_HOLDERS)):
            continue
        bad += [f"{name} imports {t}" for t in _imports(path, name, {}, annotations=True)
                if _within(t, ("service.runner",))]
    assert not bad, "the runner reached around the request front:\n" + "\n".join(sorted(bad))


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)
