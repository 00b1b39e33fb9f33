"""The import layout: one import name (`segctl`) and imports that point one way.

Every import of our packages goes through `segctl.` (a bare `import engine` would
load a second copy of a module, with its own enums and classes); the wheel
installs only `segctl/`; and orchestrator -> node -> engine -> schemas, with the
engine never importing Ray. The lab rig (lab/) stands beside the orchestrator:
it imports schemas and node, and only the CLI imports it."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("schemas", "engine", "node", "lab", "orchestrator")   # lowest first
# what each package may import of ours
ALLOWED = {"schemas": {"schemas"}, "engine": {"schemas", "engine"},
           "node": {"schemas", "engine", "node"},
           "lab": {"schemas", "node", "lab"},   # never the orchestrator (nor its head)
           "orchestrator": {"schemas", "engine", "node", "orchestrator"}}
# ... and a folder that may import more than its package: the CLI drives the lab
ALLOWED_IN = {"orchestrator/cli": ALLOWED["orchestrator"] | {"lab"}}


def _imports(path):
    """(line, the imported module's full name) of every absolute import in `path`."""
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            yield from ((n.lineno, a.name) for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            if n.module == "segctl":   # `from segctl import lab`: the module is segctl.lab
                yield from ((n.lineno, f"segctl.{a.name}") for a in n.names)
            else:
                yield n.lineno, n.module


def _sources():
    for folder in PACKAGES + ("tests", "bench", "examples", "segctl"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_our_packages_are_imported_only_as_segctl_subpackages():
    bare = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _sources()
            for line, name in _imports(p) if name.split(".")[0] in PACKAGES]
    assert not bare, "import these as segctl.X:\n" + "\n".join(bare)


def test_imports_point_one_way_and_the_engine_never_imports_ray():
    wrong = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            allowed = ALLOWED_IN.get(p.parent.relative_to(ROOT).as_posix(), ALLOWED[pkg])
            for line, name in _imports(p):
                parts = name.split(".")
                ours = parts[1] if parts[0] == "segctl" and len(parts) > 1 else None
                if ours and ours not in allowed:
                    wrong.append(f"{p.relative_to(ROOT)}:{line}: {name}")
                if pkg in ("schemas", "engine") and parts[0] == "ray":
                    wrong.append(f"{p.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "\n".join(wrong)


def test_the_wheel_installs_one_top_level_name(tmp_path):
    pytest.importorskip("setuptools")   # in the test extras: make install has it
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [wheel] = tmp_path.glob("segctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"segctl"}, tops
    for pkg in PACKAGES:
        assert f"segctl/{pkg}/__init__.py" in names
    assert "segctl/engine/step.py" in names and "segctl/node/worker.py" in names
    # a subpackage inside one of the folders, and the report page's script (package data)
    assert {"segctl/orchestrator/cli/__init__.py", "segctl/orchestrator/cli/__main__.py",
            "segctl/orchestrator/report.js"} <= set(names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "segctl = segctl.orchestrator.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_worker_module_resolves_by_name_with_nothing_on_its_path(tmp_path):
    """What an attempt's process gets (node/attempt.py starts `python -m
    segctl.node.worker` this way): no PYTHONPATH, its cwd elsewhere. The fleet
    tests run real attempts through it."""
    code = "import importlib.util as u; print(u.find_spec('segctl.node.worker').origin)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).resolve() == ROOT / "node" / "worker.py"


def test_a_checkout_resolves_segctl_subpackages_through_its_links_alone(tmp_path):
    """segctl/engine is a link to engine/ (one per entry of pyproject's package-dir),
    so the file system alone says where `segctl.engine` is: no path is added at
    run time, and a static tool follows it as Python does. Here with no site
    packages at all (no editable install's finder), the checkout on the path."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in dirs.items():
        if name.count(".") == 1:
            link = ROOT / "segctl" / name.split(".")[1]
            assert link.is_symlink() and link.resolve() == ROOT / folder, link
    assert "__path__" not in (ROOT / "segctl" / "__init__.py").read_text()
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import importlib.util as u; "
            "print(u.find_spec('segctl.node.worker').origin)")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(ROOT / "segctl" / "node" / "worker.py")


def test_segctl_sizes_mlxs_attention_caches_before_mlx_loads(tmp_path):
    """MLX reads its CUDA attention cache sizes when it loads: every entry point
    imports segctl first, which sets them unless the user did."""
    code = ("import os, segctl, mlx.core; "
            "print(os.environ['MLX_CUDA_SDPA_CACHE_SIZE'], "
            "os.environ['MLX_CUDA_SDPA_BACKWARD_CACHE_SIZE'])")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                                       env=env | extra, capture_output=True, text=True,
                                       timeout=120).stdout.split()
    assert run({}) == ["2048", "2048"]
    assert run({"MLX_CUDA_SDPA_CACHE_SIZE": "64"}) == ["64", "2048"]
    # the benchmark imports segctl before MLX too
    first = [l for l in (ROOT / "bench" / "engine.py").read_text().splitlines()
             if l.startswith(("import segctl", "import mlx"))]
    assert first[0].startswith("import segctl"), first


def test_the_cli_starts_without_the_heavy_libraries(tmp_path):
    """`segctl status`, `logs`, `gather` pay the CLI's start-up each time: its
    module names states, methods and exit codes from stdlib-only schemas, and
    loads pydantic, Ray, MLX and Arrow only in the commands that use them."""
    code = ("import sys, segctl.orchestrator.cli; "
            "print(' '.join(m for m in ('pydantic', 'ray', 'mlx', 'pyarrow', 'numpy', 'yaml') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [], proc.stdout


# Sizes a reader can hold: product code (the packages, not tests/ or bench/), in
# lines of code (not blank, not comments; docstrings count).
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 400, 120


def _code_lines(source: str) -> set[int]:
    import io
    import tokenize
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    return {line for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type not in skip for line in range(tok.start[0], tok.end[0] + 1)}


def test_no_module_class_or_function_past_its_size():
    too_long = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            code = _code_lines(source)
            name = path.relative_to(ROOT)
            if len(code) > MAX_MODULE_LINES:
                too_long.append(f"{name}: {len(code)} lines (module, at most {MAX_MODULE_LINES})")
            for n in ast.walk(ast.parse(source)):
                limit = (MAX_CLASS_LINES if isinstance(n, ast.ClassDef) else MAX_FUNCTION_LINES
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
                if limit is not None:
                    lines = len(code & set(range(n.lineno, (n.end_lineno or n.lineno) + 1)))
                    if lines > limit:
                        too_long.append(f"{name}:{n.lineno}: {n.name}: {lines} lines (at most {limit})")
    assert not too_long, "\n".join(too_long)
