"""The package's layers point one way: kernels import only torch, triton and the torch-only references below them,
only the attention seam imports the attention kernel, and no two modules of fat5 import each other in a cycle
(imports inside functions count: a lazy import hides a cycle, it does not remove it)."""

import ast
import sys
from pathlib import Path

import fat5

PACKAGE_DIR = Path(fat5.__file__).resolve().parent
# Modules the kernels may import from the package: plain torch, nothing of the model above them.
KERNEL_DEPENDENCIES = {"fat5.reference_fat5"}
# Besides the standard library.
KERNEL_THIRD_PARTY = {"torch", "triton"}
STANDARD_LIBRARY = set(sys.stdlib_module_names)


def module_name(path):
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def imported_modules(name):
    """(fat5 modules, top-level third-party names) imported anywhere in module `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from package import module` imports the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "fat5":
                internal.add(target)
            else:
                external.add(target.split(".")[0])
    assert internal <= set(MODULES), (name, internal - set(MODULES))
    return internal, external


def test_no_import_cycle_among_fat5_modules():
    graph = {name: imported_modules(name)[0] - {name} for name in MODULES}
    finished, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in finished:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        finished.add(name)

    for name in MODULES:
        visit(name)


def test_kernels_depend_only_on_torch_triton_and_references():
    kernels = [name for name in MODULES if name.startswith("fat5.kernels.")]
    assert kernels
    for name in kernels:
        internal, external = imported_modules(name)
        assert internal <= KERNEL_DEPENDENCIES, (name, internal)
        assert external <= KERNEL_THIRD_PARTY | STANDARD_LIBRARY, (name, external)
        assert "triton" in external, f"{name} is not a Triton kernel: it belongs outside kernels/"
    for name in KERNEL_DEPENDENCIES:
        internal, external = imported_modules(name)
        assert internal == set() and external <= KERNEL_THIRD_PARTY | STANDARD_LIBRARY, (name, internal, external)


def test_only_the_attention_seam_imports_the_attention_kernel():
    importers = {name for name in MODULES if "fat5.kernels.flash_attention_t5" in imported_modules(name)[0]}
    assert importers == {"fat5.attention_fat5"}

