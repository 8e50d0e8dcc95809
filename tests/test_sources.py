"""Code named by what it is: a model file's module has one label under every name, from
every folder and from a notebook cell's text; a traced file's code is found wherever the
file lies now, and an edit anywhere it is loaded is a change."""

from __future__ import annotations

import linecache
import os
import sys
import time
import types

import pytest

from cachebuild.tracing.guards import qualname
from cachebuild.trust import sources
from cachebuild.trust.codehash import ast_hash_text


def _module(monkeypatch, name: str, path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _cell(monkeypatch, name: str, text: str) -> None:
    monkeypatch.setitem(linecache.cache, name, (len(text), None, text.splitlines(True), name))


CODE = "class Served:\n    def forward(self):\n        return 1  # the same code anywhere\n"


def test_a_module_is_labelled_by_its_code_under_every_name_and_folder(monkeypatch, tmp_path):
    labels = []
    for name, folder in [("cachebuild_model_0123456789abcdef", "a"), ("llama", "b"),
                         ("pkg.models.llama", "c"), ("__main__", "d")]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "llama.py").write_text(CODE)
        labels.append(sources.module_label(_module(monkeypatch, name,
                                                   tmp_path / folder / "llama.py").__name__))
    assert len(set(labels)) == 1 and sources.is_label(labels[0])
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "llama.py").write_text(CODE.replace("return 1", "return 2"))
    _module(monkeypatch, "other", tmp_path / "e" / "llama.py")
    assert sources.module_label("other") not in labels  # other code, another label
    # Installed code keeps its name; a module without a file too.
    assert sources.module_label("torch.nn") == "torch.nn"
    assert sources.module_label("no.such.module") == "no.such.module"


def test_a_notebook_cell_holding_a_files_text_is_that_files_code(monkeypatch, tmp_path):
    (tmp_path / "m.py").write_text(CODE)
    _module(monkeypatch, "m_from_file", tmp_path / "m.py")
    _cell(monkeypatch, "<cell-3>", CODE)
    namespace = {"__name__": "__main__"}  # a script's name: its file is not the cell
    exec(compile(CODE, "<cell-3>", "exec"), namespace)
    cls = namespace["Served"]
    assert sources.object_label(cls) == sources.module_label("m_from_file")
    assert qualname(cls) == f"{sources.module_label('m_from_file')}.Served"
    # Text without linecache (python -c, a bare exec) has no source: named by module.
    bare = {"__name__": "bare_cell"}
    exec(compile(CODE, "<string>", "exec"), bare)
    assert sources.object_label(bare["Served"]) == "bare_cell"


def test_a_traced_file_is_found_where_it_lies_now(monkeypatch, tmp_path):
    build, serve = tmp_path / "build", tmp_path / "serve"
    build.mkdir()
    serve.mkdir()
    (build / "layers.py").write_text(CODE)
    digest = sources.file_digest(str(build / "layers.py"))
    recorded = str(build / "layers.py")
    assert sources.changed(recorded, digest) is None  # the file itself, not imported yet

    # Served from a copy in another folder, under another name; the build folder gone.
    (serve / "layers.py").write_text(CODE + "\n# a comment changes nothing\n")
    (build / "layers.py").unlink()
    _module(monkeypatch, "app.layers", serve / "layers.py")
    assert sources.changed(recorded, digest) is None

    # The copy this process loaded is edited: changed, named where it is.
    (serve / "layers.py").write_text(CODE.replace("return 1", "return 3"))
    assert sources.changed(recorded, digest) == str(serve / "layers.py")
    # ... even while an unedited copy lies at the recorded path.
    (build / "layers.py").write_text(CODE)
    assert sources.changed(recorded, digest) == str(serve / "layers.py")


def test_code_found_nowhere_is_changed_and_a_cell_with_its_text_is_found(monkeypatch, tmp_path):
    recorded = str(tmp_path / "gone" / "cb_sources_gone.py")
    digest = ast_hash_text(CODE.encode())
    assert sources.changed(recorded, digest) == f"{recorded} (not found)"
    _cell(monkeypatch, "<cell-9>", CODE)
    assert sources.changed(recorded, digest) is None


def test_a_module_root_is_found_by_its_source_under_another_name(monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "helpers.py").write_text(CODE)
    root = sources.module_root(_module(monkeypatch, "cachebuild_model_x",
                                       tmp_path / "a" / "helpers.py").__name__)
    assert root[0] == "module" and sources.is_label(root[1]) and root[2] == "helpers.py"
    monkeypatch.delitem(sys.modules, "cachebuild_model_x")
    assert sources.find_module(root[1], root[2]) is None
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "helpers.py").write_text(CODE)
    served = _module(monkeypatch, "pkg.helpers", tmp_path / "b" / "helpers.py")
    assert sources.find_module(root[1], root[2]) is served
    assert sources.module_root("torch") == ["module", "torch"]


@pytest.mark.parametrize("text", ["x = 1\n", "x = 1  # note\n\n"])
def test_comments_do_not_change_a_label(monkeypatch, tmp_path, text):
    (tmp_path / "c.py").write_text(text)
    _module(monkeypatch, "c_mod", tmp_path / "c.py")
    (tmp_path / "d.py").write_text("x = 1\n")
    _module(monkeypatch, "d_mod", tmp_path / "d.py")
    assert sources.module_label("c_mod") == sources.module_label("d_mod")


def test_explain_names_the_part_of_code_identity_that_differs(monkeypatch, tmp_path):
    """Never ``Served → Served``: the file, the module, the source's hash or the name."""
    from cachebuild.tracing.guards import Mismatch

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.py").write_text(CODE)
    _module(monkeypatch, "cachebuild_model_1a2b", tmp_path / "a" / "m.py")
    before = sources.module_label("cachebuild_model_1a2b")
    known = sources.source_data({before})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "m.py").write_text(CODE.replace("return 1", "return 2"))
    _module(monkeypatch, "m", tmp_path / "b" / "m.py")
    after = sources.module_label("m")

    said = Mismatch("the model", {"type": f"{before}.Served"}, {"type": f"{after}.Served"},
                    known).describe()
    old, new = known[before]["digest"][:8], after[len("<src:"):len("<src:") + 8]
    assert said == (f"the model: Served: module cachebuild_model_1a2b → m, "
                    f"source of m.py {old} → {new}"), said
    assert "Served → Served" not in said

    renamed = Mismatch("inner", {"type": f"{before}.Inner"}, {"type": f"{before}.Outer"},
                       known).describe()
    assert renamed == "inner: Inner → Outer", renamed
    library = Mismatch("act", {"type": "torch.nn.modules.activation.SiLU"},
                       {"type": "torch.nn.modules.activation.GELU"}).describe()
    assert library == "act: SiLU → GELU"
    function = Mismatch("globals.act", {"function": f"{before}.act", "code": "1" * 32},
                        {"function": f"{before}.act", "code": "2" * 32}).describe()
    assert function == "globals.act: act: code 11111111 → 22222222", function


def test_a_library_file_is_found_as_that_librarys_file_only(monkeypatch, tmp_path):
    """Traced in another environment (its folder gone here): found by its path inside the
    library folder, never as a loaded ``config.py`` outside libraries or of another
    library; an edited copy here is a change, named where it lies."""
    lib = tmp_path / "site-packages"
    (lib / "liba").mkdir(parents=True)
    (lib / "liba" / "config.py").write_text(CODE)
    (lib / "libb").mkdir()
    (lib / "libb" / "config.py").write_text("x = 2\n")
    monkeypatch.setattr(sources, "library_roots", lambda: (str(lib) + "/",))
    recorded = "/gone/venv/lib/site-packages/liba/config.py"
    digest = sources.file_digest(str(lib / "liba" / "config.py"))
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "config.py").write_text("y = 3\n")
    _module(monkeypatch, "config", tmp_path / "app" / "config.py")  # an editable install's
    _module(monkeypatch, "libb.config", lib / "libb" / "config.py")
    assert sources.stale({recorded: digest}, {}, {recorded: "liba/config.py"}) == []
    # Loaded from elsewhere under its module name (an editable install of the library).
    (tmp_path / "src" / "liba").mkdir(parents=True)
    (tmp_path / "src" / "liba" / "config.py").write_text(CODE.replace("return 1", "return 4"))
    _module(monkeypatch, "liba.config", tmp_path / "src" / "liba" / "config.py")
    assert sources.stale({recorded: digest}, {}, {recorded: "liba/config.py"}) == [
        str(tmp_path / "src" / "liba" / "config.py")]
    monkeypatch.delitem(sys.modules, "liba.config")
    (lib / "liba" / "config.py").write_text(CODE.replace("return 1", "return 5"))
    assert sources.stale({recorded: digest}, {}, {recorded: "liba/config.py"}) == [
        str(lib / "liba" / "config.py")]
    (lib / "liba" / "config.py").unlink()
    assert sources.stale({recorded: digest}, {}, {recorded: "liba/config.py"}) == [
        f"{recorded} (not found)"]


def test_a_changed_copy_is_named_not_another_file_of_its_name(monkeypatch, tmp_path):
    for folder, text in [("model", CODE), ("server", "z = 1\n")]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "helpers.py").write_text(text)
    digest = sources.file_digest(str(tmp_path / "model" / "helpers.py"))
    _module(monkeypatch, "server_helpers", tmp_path / "server" / "helpers.py")
    _module(monkeypatch, "helpers", tmp_path / "model" / "helpers.py")
    recorded = str(tmp_path / "model" / "helpers.py")
    assert sources.changed(recorded, digest) is None
    (tmp_path / "model" / "helpers.py").write_text(CODE.replace("return 1", "return 6"))
    assert sources.changed(recorded, digest) == recorded


def test_a_same_size_edit_with_its_time_put_back_is_a_change(monkeypatch, tmp_path):
    """An edit that keeps the file's size and puts its modification time back (``touch
    -r``, an image build that gives every file one time) still changes its stamp: the
    change time is the kernel's. A stamp is not kept for a file changed just now (the
    kernel's clock for file times is coarse), so such a file is read again."""
    path = tmp_path / "stamped_source_under_test.py"  # no loaded module has its name
    path.write_text(CODE)
    os.utime(path, ns=(10**18, 10**18))
    assert sources.stamped_digest(str(path))[1] is None  # changed less than RACY_S ago
    monkeypatch.setattr(sources, "RACY_S", 0.0)
    digest, stamp = sources.stamped_digest(str(path))
    assert stamp is not None and sources.changed(str(path), digest, stamp) is None
    time.sleep(0.05)  # past the kernel's tick, as a real edit would be
    path.write_text(CODE.replace("return 1", "return 7"))
    os.utime(path, ns=(10**18, 10**18))
    assert path.stat().st_size == stamp[0] and path.stat().st_mtime_ns == stamp[1]
    assert sources.changed(str(path), digest, stamp) == str(path)
