"""Trust, the toolchain probe: another local user can steer neither the probe folder nor
the compiler a build runs (issue 25, item 3).

Real processes; the other user is uid 65534, whose directories the tests make as root
(skipped elsewhere). A compiler here is a shell script that creates a canary file when it
runs: a test fails if a canary exists, whatever the command said.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from trust import NOBODY, assert_one_line_error, clean_env, cli, public_dir, python, require_root

from cachebuild.backends import probe
from cachebuild.store import LocalStore

#: A "compiler" that leaves a canary, then behaves like the system's.
COMPILER = """#!/bin/sh
touch {canary}
exec {gxx} "$@"
"""

#: What the probe decides in a fresh process: candidates, then the verdict (or the
#: one-line error, exit 2).
VERDICT = textwrap.dedent("""
    import json, sys
    from cachebuild.backends import probe
    from cachebuild.errors import CachebuildError
    trusted, refused = probe.trusted_candidates()
    try:
        v = probe.verdict("cpu")
    except CachebuildError as e:
        print("error:", " ".join(str(e).split()), file=sys.stderr)
        sys.exit(e.exit_code)
    print(json.dumps({"candidates": probe.candidate_compilers(), "trusted": trusted,
                      "refused": refused, "verdict": v.to_json()}))
""")


def system_gxx() -> str:
    found = [p for p in probe.SYSTEM_COMPILERS if os.access(p, os.X_OK)]
    if not found:
        pytest.skip("no system C++ compiler (/usr/bin/g++)")
    return found[0]


def fake_compiler(folder: Path, name: str, canary: Path) -> Path:
    path = folder / name
    path.write_text(COMPILER.format(canary=canary, gxx=system_gxx()))
    path.chmod(0o755)
    return path


def others_dir(public: Path, name: str) -> Path:
    """A directory of ``public`` owned by the other user."""
    path = public / name
    path.mkdir(mode=0o755)
    os.chown(path, NOBODY, NOBODY)
    return path


def test_a_probe_folder_another_user_could_swap_is_refused(tmp_path):
    require_root()
    with public_dir() as public:
        theirs = others_dir(public, "theirs")
        env = clean_env(CACHEBUILD_PROBE_DIR=str(theirs / "probe"))
        assert_one_line_error(python(VERDICT, env=env), 2, r"theirs above it is owned by uid "
                                                           r"65534")
        # Not owned by them, but in a folder anyone may rename entries of.
        open_dir = public / "open"
        open_dir.mkdir()
        os.chmod(open_dir, 0o777)
        (open_dir / "probe").mkdir(mode=0o700)
        env = clean_env(CACHEBUILD_PROBE_DIR=str(open_dir / "probe"))
        assert_one_line_error(python(VERDICT, env=env), 2, r"open above it is writable by "
                                                           r"others")
        # stats says so instead of reading verdicts from there.
        LocalStore(tmp_path / "store").close()
        proc = cli("--cache-dir", str(tmp_path / "store"), "stats", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "open above it is writable by others" in " ".join(proc.stdout.split())


def test_compilers_another_user_could_replace_are_never_run(tmp_path):
    require_root()
    with public_dir() as public:
        theirs = others_dir(public, "bin")
        canary = tmp_path / "ran"
        fake_compiler(theirs, "g++", canary)
        fake_compiler(theirs, "c++", canary)
        owned = others_dir(public, "cxx")
        cxx = fake_compiler(owned, "their-cxx", canary)
        plant = tmp_path / "probe"
        for extra in ({"PATH": f"{theirs}:{os.environ['PATH']}"}, {"CXX": str(cxx)}):
            env = clean_env(CACHEBUILD_PROBE_DIR=str(plant), **extra)
            # A verdict for this environment is planted, so that nothing is probed: what
            # is run (or not) is the candidates' checks and the verdict's.
            code = _planted_verdict(plant)
            out = python(code + VERDICT, env=env)
            assert out.returncode == 0, out.stderr[-3000:]
            found = json.loads(out.stdout.splitlines()[-1])
            untrusted = [p for p, _ in found["refused"]]
            assert untrusted and all(p.startswith(str(public)) for p in untrusted)
            assert all("not run: another user could replace it" in w
                       for _, w in found["refused"])
            assert not any(p.startswith(str(public)) for p in found["trusted"])
            assert not canary.exists()
            shutil.rmtree(plant)


def _planted_verdict(folder: Path) -> str:
    """Code that writes the verdict of this environment, naming the system compiler, as a
    probe would have (no child runs)."""
    return textwrap.dedent(f"""
        import json, os
        from pathlib import Path
        from cachebuild.backends import probe
        folder = Path({str(folder)!r})
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        trusted, refused = probe.trusted_candidates()
        gxx = {system_gxx()!r}
        v = probe.Verdict("cpu", probe.Compiler.found(gxx, "g++ (planted)"), refused)
        fp = probe._fingerprint("cpu", probe.candidate_compilers())
        (folder / f"aoti-cpu-{{fp}}.json").write_text(json.dumps(v.to_json()))
    """)


def test_with_cxx_set_the_path_compiler_is_not_a_candidate(tmp_path):
    canary = tmp_path / "path-compiler-ran"
    ours = tmp_path / "bin"
    ours.mkdir()
    fake_compiler(ours, "g++", canary)
    fake_compiler(ours, "c++", canary)
    cxx = fake_compiler(tmp_path, "chosen-cxx", tmp_path / "cxx-ran")
    env = clean_env(CACHEBUILD_PROBE_DIR=str(tmp_path / "probe"), CXX=str(cxx),
                    PATH=f"{ours}:{os.environ['PATH']}")
    out = python(_planted_verdict(tmp_path / "probe") + VERDICT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert found["candidates"][0] == str(cxx)
    assert not any(p.startswith(str(ours)) for p in found["candidates"])
    assert not canary.exists()


def test_a_verdicts_compiler_is_checked_again_before_every_use(tmp_path, monkeypatch):
    require_root()
    with public_dir() as public:
        folder = public / "tools"
        folder.mkdir(mode=0o755)
        compiler = fake_compiler(folder, "g++", tmp_path / "ran")
        verdict = probe.Verdict("cpu", probe.Compiler.found(str(compiler), "g++ (test)"))
        assert probe.unusable(verdict) is None
        # Someone who may (root, here) changes the file: it is not the compiler probed.
        compiler.write_text(compiler.read_text() + "# changed\n")
        assert "is not the file that was probed" in probe.unusable(verdict)
        verdict = probe.Verdict("cpu", probe.Compiler.found(str(compiler), "g++ (test)"))
        # The folder passes to another user: they could replace the file.
        os.chown(folder, NOBODY, NOBODY)
        assert "could be replaced by another user" in probe.unusable(verdict)
        # stats shows the verdict and why it is not used.
        probe_dir = tmp_path / "probe"
        probe_dir.mkdir(mode=0o700)
        (probe_dir / "aoti-cpu-x.json").write_text(json.dumps(verdict.to_json()))
        env = clean_env(CACHEBUILD_PROBE_DIR=str(probe_dir))
        LocalStore(tmp_path / "store").close()
        proc = cli("--cache-dir", str(tmp_path / "store"), "stats", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "not used: " in proc.stdout and "could be replaced by another user" in \
            " ".join(proc.stdout.split())
        # A build whose manifest names that compiler refuses before running it.
        from cachebuild.backends.probe import UntrustedCompiler, trusted_compiler

        with pytest.raises(UntrustedCompiler, match="another user could replace it"):
            trusted_compiler(str(compiler))
        assert not (tmp_path / "ran").exists()


def test_kernel_binaries_are_linked_only_with_tools_no_other_user_could_replace(monkeypatch):
    """A CUDA package links its kernels' binaries with the ``ld`` and ``objcopy`` found on
    PATH: where either is in a folder another user owns, packages name the binaries'
    files instead (the wrapper is compiled again after an edit, nothing else changes)."""
    from cachebuild.backends.inductor import kernel_binaries_linked

    require_root()
    if shutil.which("ld") is None or shutil.which("objcopy") is None:
        pytest.skip("no binutils here")
    assert kernel_binaries_linked() == {"aot_inductor.embed_kernel_binary": True}
    with public_dir() as public:
        theirs = others_dir(public, "bin")
        for tool in ("ld", "objcopy"):
            (theirs / tool).write_text("#!/bin/sh\nexit 1\n")
            os.chmod(theirs / tool, 0o755)
        monkeypatch.setenv("PATH", f"{theirs}:{os.environ['PATH']}")
        assert kernel_binaries_linked() == {}


def test_an_environment_folder_that_cannot_be_made_is_said_once_with_the_fix(monkeypatch,
                                                                            caplog):
    """A HOME that cannot be written: builds go on (verdict in memory), and the one line
    that says so names the variable that keeps verdicts and headers for every build."""
    from cachebuild.errors import StoreError

    def refused(folder=None):
        raise StoreError("cannot create environment folder /ro/home/.cache: read-only")

    monkeypatch.delenv("CACHEBUILD_PROBE_DIR", raising=False)
    monkeypatch.setattr(probe, "checked_dir", refused)
    assert probe.usable_dir() is None and probe.usable_dir() is None
    said = [r.getMessage() for r in caplog.records if "cannot be used here" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("cachebuild: the environment folder")
    assert "name a folder you can write in CACHEBUILD_PROBE_DIR" in said[0]
