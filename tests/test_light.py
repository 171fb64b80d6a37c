"""The light run's selection (tests/conftest.py): what a venv of the base install leaves out, and why."""

from __future__ import annotations

from light import HERE, importorskip_of, missing_imports


def test_a_test_module_importing_an_absent_package_names_it(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("import os\nimport no_such_package_rle.sub\nfrom json import dumps\n", encoding="utf-8")
    assert missing_imports(module) == ["no_such_package_rle"]


def test_a_helper_module_of_tests_is_followed():
    # tests/soak.py imports openai and the serving helper; nothing there is absent in this venv,
    # and a cycle of helpers would not loop.
    assert missing_imports(HERE / "soak.py") == []


def test_a_module_level_importorskip_counts_as_an_import():
    import ast

    [node] = ast.parse('np = pytest.importorskip("numpy")').body
    assert importorskip_of(node) == ["numpy"]
    [node] = ast.parse('x = f("numpy")').body
    assert importorskip_of(node) == []
