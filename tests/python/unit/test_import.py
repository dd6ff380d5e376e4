"""The package loads the library from anywhere and exposes the operators."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatorch

MAPPINGS = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
            "scatter_to_sp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region"]


def test_operators_exist_with_their_schemas():
    for name in MAPPINGS:
        op = getattr(torch.ops.megatorch, name).default
        assert str(op._schema) == f"megatorch::{name}(Tensor input, str group) -> Tensor"


def test_import_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGATORCH_LIBRARY"}
    out = subprocess.run([sys.executable, "-c", "import megatorch, torch; print(megatorch.library_path()); "
                          "print(torch.ops.megatorch.copy_to_tp_region)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "libmegatorch.so" in out.stdout


def test_library_override_must_exist(tmp_path):
    env = dict(os.environ, MEGATORCH_LIBRARY=str(tmp_path / "nope.so"))
    out = subprocess.run([sys.executable, "-c", "import megatorch"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "MEGATORCH_LIBRARY" in out.stderr and "nope.so" in out.stderr


def test_stats_of_an_unused_group_are_zero():
    stats = megatorch.comm_stats("never-used")
    assert set(stats) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "barrier",
                          "all_to_all", "total"}
    assert all(v == {"calls": 0, "bytes": 0} for v in stats.values())


def test_unknown_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="registered under the name 'no-such-group'"):
        torch.ops.megatorch.reduce_from_tp_region(torch.ones(2), "no-such-group")


ROOT = Path(__file__).resolve().parents[3]


def _cmake_project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(megatorch VERSION (\d+\.\d+\.\d+)", text)
    assert m, "CMakeLists.txt: expected project(megatorch VERSION X.Y.Z ...)"
    return m.group(1)


def test_versions_agree():
    # One version everywhere: CMake's project() is the source; the C++ headers are generated
    # from it, the Python package states it (pyproject.toml reads megatorch/_version.py), and
    # the loaded library reports the one it was built with.
    version = _cmake_project_version()
    assert megatorch.__version__ == version
    assert torch.ops.megatorch.version() == version
    assert megatorch.library_version() == version
    # pyproject.toml states no version of its own: [project] lists it as dynamic, read from
    # megatorch/_version.py (what __version__ is).
    pyproject = (ROOT / "torch_ext" / "pyproject.toml").read_text()
    project_table = re.search(r"^\[project\]\n(.*?)(?=^\[)", pyproject, re.M | re.S).group(1)
    assert re.search(r'^dynamic = \["version"\]', project_table, re.M), project_table
    assert not re.search(r"^version\s*=", project_table, re.M), project_table
    assert 'version = { attr = "megatorch._version.__version__" }' in pyproject
    # The header generated into the build tree of the library being tested.
    header = Path(megatorch.library_path()).resolve().parent.parent / "include" / "megatorch" / "version.h"
    if header.is_file():
        text = header.read_text()
        macros = {k: v for k, v in re.findall(r"#define MEGATORCH_VERSION_(MAJOR|MINOR|PATCH) (\d+)", text)}
        assert f"{macros['MAJOR']}.{macros['MINOR']}.{macros['PATCH']}" == version
        assert f'#define MEGATORCH_VERSION_STRING "{version}"' in text


def test_installed_metadata_agrees():
    from importlib import metadata
    try:
        installed = metadata.version("megatorch")
    except metadata.PackageNotFoundError:
        pytest.skip("megatorch is not pip-installed (PYTHONPATH=torch_ext)")
    # An editable install records the version at install time: scripts/setup.sh reinstalls
    # when pyproject.toml changes.
    assert installed == megatorch.__version__


def test_no_version_warning_on_import(tmp_path):
    # __init__ warns when the library it loaded is another version than the package.
    out = subprocess.run([sys.executable, "-c", "import megatorch"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "the Python package is" not in out.stderr
