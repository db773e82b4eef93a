"""The package's layers point one way: kernels import only torch, triton, each other and the torch-only references
below them, only the attention seam imports the attention kernel, and no two modules of fat5 import each other in a
cycle (imports inside functions count: a lazy import hides a cycle, it does not remove it)."""

import ast
import re
import sys
from pathlib import Path

import pytest

import fat5
from fat5.remote_code_fat5 import SHIPPED_FILES, flatten_imports, remote_code_files

# The modules a checkpoint loads by name (config.json's auto_map and custom_pipelines).
ENTRY_MODULES = ("configuration_fat5", "modeling_fat5", "pipeline_fat5")
RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\S*)\s+import", re.MULTILINE)
# What a checkpoint folder's code may total (wc -l of the shipped files).
SHIPPED_LINES = 4000

PACKAGE_DIR = Path(fat5.__file__).resolve().parent
# Modules the kernels may import from the package: plain torch, nothing of the model above them.
KERNEL_DEPENDENCIES = {"fat5.custom_ops_fat5", "fat5.reference_fat5"}
# Besides the standard library.
KERNEL_THIRD_PARTY = {"torch", "triton"}
STANDARD_LIBRARY = set(sys.stdlib_module_names)


def module_name(path):
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _runtime_nodes(tree):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (never run)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def imported_modules(name):
    """(fat5 modules, top-level third-party names) imported anywhere in module `name` where it can run."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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
        assert internal <= KERNEL_DEPENDENCIES | set(kernels), (name, internal)
        assert external <= KERNEL_THIRD_PARTY | STANDARD_LIBRARY, (name, external)
        assert "triton" in external, f"{name} is not a Triton kernel: it belongs outside kernels/"
    for name in KERNEL_DEPENDENCIES:
        internal, external = imported_modules(name)
        assert internal == set() and external <= KERNEL_THIRD_PARTY | STANDARD_LIBRARY, (name, internal, external)


def test_only_the_attention_seam_imports_the_attention_kernel():
    importers = {name for name in MODULES if "fat5.kernels.flash_attention_t5" in imported_modules(name)[0]}
    assert importers == {"fat5.attention_fat5"}



def test_entry_modules_name_every_exported_module_directly():
    """transformers 4.x, loading a checkpoint folder, copies only the files an entry module imports relatively
    (not what those files import) and then fails on any missing one: the entry modules must name them all."""
    files = remote_code_files()
    direct = set()
    for module in ENTRY_MODULES:
        direct.add(f"{module}.py")
        source = flatten_imports(files[f"{module}.py"].read_text())
        direct.update(f"{name}.py" for name in RELATIVE_IMPORT.findall(source))
    assert set(files) <= direct, set(files) - direct


def test_the_lazy_package_names_the_model_code_exports():
    """fat5/__init__.py lists the model classes without importing them; they are modeling_fat5's."""
    from fat5 import modeling_fat5

    assert list(fat5.MODEL_CLASSES) == modeling_fat5.__all__
    assert set(fat5.__all__) <= set(dir(fat5))


def test_commands_and_training_never_reach_up_into_the_converter():
    """Nothing below imports from above: the model package, pretraining and the recipes use the command-line
    convention of fat5/cli.py, never fat5/convert/ (the converter sits above them), nor the shims of convert/."""
    for name in MODULES:
        assert "convert" not in imported_modules(name)[1], name
        if not name.startswith("fat5.convert"):
            assert not [module for module in imported_modules(name)[0] if module.startswith("fat5.convert")], name


def test_command_line_modules_are_never_exported():
    exported = set(remote_code_files())
    assert not exported & {"cli.py", "files.py", "commands.py", "__main__.py", "__init__.py"}
    assert all("training" not in path.parts and "recipes" not in path.parts for path in remote_code_files().values())


def relative_imports(path):
    """The flat module names a shipped file imports relatively, as it reads in a checkpoint folder."""
    return set(RELATIVE_IMPORT.findall(flatten_imports(path.read_text())))


def test_the_shipped_files_are_the_model_s_import_closure():
    """SHIPPED_FILES is what a checkpoint needs: every listed file exists, its relative imports (lazy ones included)
    stay within the list, and the list is exactly the closure of the entry modules' relative imports."""
    files = remote_code_files()
    assert len(SHIPPED_FILES) == len(set(SHIPPED_FILES)) and all(path.is_file() for path in files.values()), files
    outside = {name: sorted(f"{module}.py" for module in relative_imports(path)
                            if f"{module}.py" not in SHIPPED_FILES) for name, path in files.items()}
    assert not any(outside.values()), outside
    closure, pending = set(), [f"{module}.py" for module in ENTRY_MODULES]
    while pending:
        name = pending.pop()
        if name not in closure:
            closure.add(name)
            pending.extend(f"{module}.py" for module in relative_imports(files[name]))
    assert closure == set(SHIPPED_FILES), (sorted(set(SHIPPED_FILES) - closure), sorted(closure - set(SHIPPED_FILES)))


def shipped_lines():
    return sum(len(path.read_text().splitlines()) for path in remote_code_files().values())


# Strict: once the code is within the budget this passes, which fails the run until the mark goes.
@pytest.mark.xfail(strict=True, reason="issue 47: the shipped code is over SHIPPED_LINES (6,036 lines on 2026-12-08)")
def test_the_shipped_code_stays_within_its_line_budget():
    assert shipped_lines() <= SHIPPED_LINES, shipped_lines()
