"""The architecture, kept: the layers and contracts in pyproject.toml, no import cycles, small modules,
and a protocol document that names every message kind."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ember"

pytestmark = pytest.mark.timeout(120)


def test_import_contracts_are_kept() -> None:
    # in a process of its own: import-linter reconfigures logging, which would silence ember's loggers here
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml")], capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, f"import-linter found broken contracts:\n{r.stdout}{r.stderr}"
    assert "0 broken" in r.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_between_modules() -> None:
    import grimp
    graph = grimp.build_graph("ember")
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a two-module cycle is reported."""
    class G:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return self.edges[m]
    assert _cycles(G()) == [["a", "b"]]


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 650}
    assert not big, f"modules over ~600 lines (split by responsibility): {big}"


def test_protocol_document_names_every_message_kind() -> None:
    from ember.protocol import messages as m
    doc = (ROOT / "docs" / "protocol.md").read_text()
    headings = set(re.findall(r"^#+ .*?`([A-Z_]+)`", doc, flags=re.M))
    kinds = {n.upper() for n in m.KIND_NAMES}
    assert kinds <= headings, f"message kinds without a section in docs/protocol.md: {sorted(kinds - headings)}"
    for status in ("OK", "ERROR", "CHUNK", "NEED_GRAPH"):
        assert f"`{status}`" in doc
    assert "docs/protocol.md" in (m.__doc__ or "")


def test_architecture_document_names_real_files() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`(src/ember/[\w/]+\.py)`", doc))
    assert len(paths) >= 10
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
