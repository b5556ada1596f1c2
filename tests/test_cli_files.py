"""The command line's output files: an existing file is replaced only with --force; an input of the
command (a file named, a file inside the --model folder, MODULE:CALLABLE's source) never; a
read-only file or folder, a missing folder, a file that is not a regular file: an ``error:`` line
and exit status 2, the file as it was."""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest
import viz_graphs as vg
from click.testing import CliRunner

from graphkern.cli import main

MODEL = textwrap.dedent('''
    import mlx.core as mx

    def forward(x):
        return mx.tanh(x) + 1
''')

OLD = b"old contents\n"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "a.json").write_text(vg.traced(kernel=False).to_json())
    (tmp_path / "b.json").write_text(vg.traced().to_json())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mlx_lm")
    from graphkern.models.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("files") / "ck")


#: Each command that writes files, writing ``out`` (an HTML or JSON file, or a .npz for --save).
WRITERS = {
    "trace": lambda out: ["trace", "mymodel.py:forward", "-i", "4", "--json", out],
    "show": lambda out: ["show", "b.json", "--html", out],
    "diff": lambda out: ["diff", "a.json", "b.json", "--json", out],
    "view": lambda out: ["view", "b.json", "--out", out, "--no-browser"],
    "debug": lambda out: ["debug", "mymodel.py:forward", "-i", "4", "--json", out],
    "debug --save": lambda out: ["debug", "mymodel.py:forward", "-i", "4", "--save", out],
}


def deny_writes(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``os.access`` says this user may not write paths ending in ``name`` (the tests run as root,
    who may write anything)."""
    real_access = os.access

    def access(path: str, mode: int, **kw: object) -> bool:
        if os.fspath(path).endswith(name) and mode & os.W_OK:
            return False
        return real_access(path, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)


def _out_name(command: str) -> str:
    return "values.npz" if command == "debug --save" else "out.html"


# ----------------------------------------------------------------------------- existing files


@pytest.mark.parametrize("command", WRITERS)
def test_an_existing_output_is_replaced_only_with_force(work: Path, command: str) -> None:
    out = work / _out_name(command)
    out.write_bytes(OLD)
    code, _, err = run(*WRITERS[command](out.name))
    assert code == 2 and err == f"error: {out.name} exists; pass --force to replace it\n"
    assert out.read_bytes() == OLD
    code, _, err = run(*WRITERS[command](out.name), "--force")
    assert code in (0, 1), err  # diff finds differences: 1
    assert out.read_bytes() != OLD


@pytest.mark.parametrize("command", WRITERS)
def test_a_new_output_needs_no_force_and_gets_the_usual_mode(work: Path, command: str) -> None:
    out = work / _out_name(command)
    code, _, err = run(*WRITERS[command](out.name))
    assert code in (0, 1), err
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
    assert not [p for p in work.iterdir() if p.name.startswith(".gk-")]  # no temporary file left


def test_demo_refuses_to_replace_its_files_without_force(work: Path) -> None:
    (work / "demo").mkdir()
    (work / "demo" / "graph.html").write_bytes(OLD)
    code, out, err = run("demo", "--out", "demo")
    assert code == 2 and err == f"error: {Path('demo', 'graph.html')} exists; pass --force to replace it\n"
    assert out == "" and (work / "demo" / "graph.html").read_bytes() == OLD
    code, _, err = run("demo", "--out", "demo", "--force")
    assert code == 0, err
    assert (work / "demo" / "graph.html").read_text().startswith("<!DOCTYPE html>")


def test_demo_run_again_replaces_only_what_an_earlier_demo_wrote(work: Path) -> None:
    """A demo's folder holds its mark: the next demo replaces its files, saying so on stderr; a
    file of the user's there stays refused once the mark is gone."""
    assert run("demo", "--out", "demo")[0] == 0
    assert (work / "demo" / ".graphkern-demo").is_file()
    code, _, err = run("demo", "--out", "demo")
    assert code == 0 and err == "replacing the files of an earlier demo in demo\n"
    (work / "demo" / ".graphkern-demo").unlink()
    code, _, err = run("demo", "--out", "demo")
    assert code == 2 and "exists; pass --force to replace it" in err


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_read_only_file_is_never_replaced(work: Path, force: list[str]) -> None:
    out = work / "locked.json"
    out.write_bytes(OLD)
    out.chmod(0o444)
    code, _, err = run("show", "b.json", "--html", "locked.json", *force)
    assert code == 2 and err == "error: locked.json is read-only; make it writable to replace it\n"
    assert out.read_bytes() == OLD and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_a_file_this_user_cannot_write_is_read_only(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = work / "theirs.json"
    out.write_bytes(OLD)
    deny_writes(monkeypatch, "theirs.json")
    code, _, err = run("diff", "a.json", "b.json", "--json", "theirs.json", "--force")
    assert code == 2 and "theirs.json is read-only" in err
    assert out.read_bytes() == OLD


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_what_is_not_a_regular_file_is_never_replaced(work: Path) -> None:
    os.mkfifo(work / "pipe")
    code, _, err = run("show", "b.json", "--html", "pipe", "--force")
    assert code == 2 and err == "error: pipe exists and is not a regular file; give a file path\n"
    assert stat.S_ISFIFO((work / "pipe").stat().st_mode)


def test_two_options_naming_one_file_are_refused(work: Path) -> None:
    code, _, err = run("trace", "mymodel.py:forward", "-i", "4", "--json", "g.json", "--dot", "./g.json")
    assert code == 2 and err == "error: --json and --dot both write ./g.json; give each its own file\n"
    assert not (work / "g.json").exists()


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("args, output", [
    (["diff", "a.json", "b.json", "--json", "a.json"], "a.json"),
    (["diff", "a.json", "b.json", "--html", "b.json"], "b.json"),
    (["show", "a.json", "--dot", "a.json"], "a.json"),
    (["view", "a.json", "--out", "a.json", "--no-browser"], "a.json"),
    (["trace", "mymodel.py:forward", "-i", "4", "--json", "mymodel.py"], "mymodel.py"),
    (["trace", "mymodel:forward", "-i", "4", "--html", "mymodel.py"], "mymodel.py"),
    (["debug", "mymodel.py:forward", "-i", "4", "--save", "mymodel.py"], "mymodel.py"),
])
def test_an_input_of_the_command_is_never_replaced(work: Path, args: list[str], output: str,
                                                   force: list[str]) -> None:
    before = (work / output).read_bytes()
    code, _, err = run(*args, *force)
    assert code == 2, err
    assert err.startswith(f"error: {output} is an input of this command (")
    assert "--force never replaces an input" in err
    assert (work / output).read_bytes() == before


def test_an_input_reached_through_a_link_is_never_replaced(work: Path) -> None:
    (work / "link.json").symlink_to(work / "a.json")
    os.link(work / "a.json", work / "hard.json")
    before = (work / "a.json").read_bytes()
    for name in ("link.json", "hard.json"):
        code, _, err = run("diff", "a.json", "b.json", "--json", name, "--force")
        assert code == 2 and f"error: {name} is an input of this command (a.json)" in err, err
    assert (work / "a.json").read_bytes() == before and (work / "link.json").is_symlink()


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("command", ["trace", "debug"])
def test_no_file_of_the_model_folder_is_replaced(checkpoint: Path, tmp_path: Path, command: str,
                                                force: list[str]) -> None:
    config = checkpoint / "config.json"
    before = config.read_bytes()
    code, _, err = run(command, "--model", str(checkpoint), "--json", str(config), *force)
    assert code == 2
    assert err.startswith(f"error: {config} is an input of this command (inside {checkpoint})")
    assert config.read_bytes() == before
    new_file = checkpoint / "graph.json"  # a new file inside the folder: refused as well
    code, _, err = run(command, "--model", str(checkpoint), "--json", str(new_file), *force)
    assert code == 2 and "is an input of this command" in err and not new_file.exists()


# ----------------------------------------------------------------------------- folders


def test_a_read_only_folder_is_an_error_line(work: Path) -> None:
    locked = work / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for args in (["show", "b.json", "--html", "locked/g.html"],
                     ["debug", "mymodel.py:forward", "-i", "4", "--save", "locked/v.npz"]):
            code, _, err = run(*args)
            assert code == 2 and err.startswith("error: ") and f"folder {locked} is read-only" in err, err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_a_folder_this_user_cannot_write_is_read_only(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (work / "theirs").mkdir()
    deny_writes(monkeypatch, "theirs")
    code, _, err = run("view", "b.json", "--out", "theirs/v.html", "--no-browser")
    assert code == 2 and f"error: --out theirs/v.html: folder {work / 'theirs'} is read-only" in err
    assert not (work / "theirs" / "v.html").exists()


@pytest.mark.parametrize("args", [
    ["view", "b.json", "--out", "no/such/v.html", "--no-browser"],
    ["debug", "mymodel.py:forward", "-i", "4", "--save", "no/such/v.npz"],
    ["diff", "a.json", "b.json", "--json", "no/such/d.json"],
])
def test_a_missing_folder_is_an_error_line(work: Path, args: list[str]) -> None:
    code, _, err = run(*args)
    assert code == 2 and err.startswith("error: ") and "does not exist" in err


def test_a_failed_write_is_an_error_line_not_a_traceback(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.viz.common as common

    def refused(path: str, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(common, "atomic_write", refused)
    code, _, err = run("show", "b.json", "--html", "g.html")
    assert code == 2 and err == "error: cannot write g.html: Permission denied\n"


def test_a_file_that_appears_while_the_command_runs_is_not_replaced(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.cli.commands as commands

    real = commands.render_outputs

    def render_then_someone_writes(*args, **kwargs):  # type: ignore[no-untyped-def]
        files = real(*args, **kwargs)
        (work / "g.html").write_bytes(OLD)
        return files

    monkeypatch.setattr(commands, "render_outputs", render_then_someone_writes)
    code, _, err = run("show", "b.json", "--html", "g.html")
    assert code == 2 and err == "error: g.html exists; pass --force to replace it\n"
    assert (work / "g.html").read_bytes() == OLD


@pytest.mark.parametrize("command", ["trace", "show", "diff", "view", "debug", "demo"])
def test_every_command_that_writes_files_has_force(command: str) -> None:
    code, out, _ = run(command, "--help")
    assert code == 0 and "--force" in out and "Replace output files that exist" in out
