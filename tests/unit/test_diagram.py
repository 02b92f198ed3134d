"""Workflow.to_mermaid() and `flowlock diagram module:attr`: the Mermaid text, and every way a
reference can be wrong (a clear error and exit code, never a traceback)."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flowlock
from flowlock import examples
from flowlock.cli import app


def test_approval_as_mermaid() -> None:
    """Initial state, one labelled edge per event, final states to [*]."""
    assert examples.approval().to_mermaid() == textwrap.dedent(
        """\
        stateDiagram-v2
            [*] --> pending
            pending --> approved: approve
            pending --> rejected: reject
            approved --> [*]
            rejected --> [*]
        """
    )


def test_guarded_edges_and_several_targets() -> None:
    """A guarded transition is marked; a transition with several targets draws one edge each;
    a workflow with no final state has no `--> [*]`."""
    assert examples.countersign(2).to_mermaid().splitlines()[2:] == [
        "    pending --> pending: sign [guarded]",
        "    pending --> approved: sign [guarded]",
        "    approved --> [*]",
    ]
    inventory = examples.inventory().to_mermaid()
    assert "    open --> open: reserve [guarded]" in inventory.splitlines()
    assert "    open --> open: restock" in inventory.splitlines()
    assert "--> [*]" not in inventory


def test_names_mermaid_would_misread_are_aliased() -> None:
    """States with '-' or '.' in them, or named like a Mermaid keyword, are declared with their
    name as the label and an id Mermaid reads."""
    wf = flowlock.Workflow(
        "review",
        states=["s1", "in-review", "end", "v1.2"],
        initial="s1",
        transitions=[
            flowlock.Transition("submit", source="s1", target="in-review"),
            flowlock.Transition("finish", source="in-review", target=["end", "v1.2"]),
        ],
    )
    lines = wf.to_mermaid().splitlines()
    assert lines[:4] == [
        "stateDiagram-v2",
        '    state "in-review" as s1_',
        '    state "end" as s2',
        '    state "v1.2" as s3',
    ]
    assert "    s1 --> s1_: submit" in lines
    assert "    s1_ --> s2: finish" in lines and "    s1_ --> s3: finish" in lines
    assert "    s2 --> [*]" in lines and "    s3 --> [*]" in lines


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in the current directory (as in a project's root); returns its name."""
    name = f"flows_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """\
            import flowlock
            from flowlock import examples

            approval = examples.approval()
            several = [examples.approval(), examples.inventory()]
            number = 3

            class Holder:
                flow = examples.countersign(2)

            def build():
                return examples.inventory()

            def build_many():
                return (examples.approval(), examples.countersign(3))

            def broken():
                raise KeyError("config")
            """
        ),
        encoding="utf-8",
    )
    (tmp_path / f"{name}_async.py").write_text(
        textwrap.dedent(
            """\
            import flowlock

            async def allowed(instance, payload, actor):
                return True

            flow = flowlock.Workflow(
                "x", states=["a"], initial="a",
                transitions=[flowlock.Transition("go", source="a", target="a", guard=allowed)],
            )
            """
        ),
        encoding="utf-8",
    )
    (tmp_path / f"{name}_needs.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.chdir(tmp_path)
    # The command puts the current directory on sys.path; the test's copy is thrown away after.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    return name


@pytest.mark.parametrize(
    ("attr", "names"),
    [
        ("approval", ["approval"]),
        ("several", ["approval", "inventory"]),
        ("Holder.flow", ["countersign"]),
        ("build", ["inventory"]),
        ("build_many", ["approval", "countersign"]),
    ],
)
def test_diagram_prints_what_the_reference_names(project: str, attr: str, names: list[str]) -> None:
    """A Workflow, a list of them, a nested attribute, a function returning one or several."""
    result = CliRunner().invoke(app, ["diagram", f"{project}:{attr}"])
    assert result.exit_code == 0, result.output
    expected = {wf.name: wf for wf in (examples.approval(), examples.inventory())}
    expected["countersign"] = examples.countersign(2)
    if len(names) == 1:
        assert result.stdout == expected[names[0]].to_mermaid()
    else:
        assert result.stdout.count("stateDiagram-v2") == len(names)
        assert [line for line in result.stdout.splitlines() if line.startswith("%%")] == [
            f"%% workflow: {n}" for n in names
        ]
        assert expected["approval"].to_mermaid() in result.stdout


@pytest.mark.parametrize(
    ("reference", "said"),
    [
        ("{p}", "is not a reference of the form module:attr"),
        ("{p}:", "is not a reference of the form module:attr"),
        (":approval", "is not a reference of the form module:attr"),
        ("no_such_module_xyz:flow", "no module named 'no_such_module_xyz'"),
        ("{p}:nope", "has no attribute 'nope'"),
        ("{p}:Holder.nope", "has no attribute 'Holder.nope'"),
        ("{p}:number", "is of type int; it must be a flowlock.Workflow"),
    ],
)
def test_a_bad_reference_is_a_usage_error(project: str, reference: str, said: str) -> None:
    """A reference that names no workflow exits 2 (bad argument) saying what is wrong."""
    result = CliRunner().invoke(app, ["diagram", reference.format(p=project)])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()).replace("│ ", "").replace(" │", "")
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("reference", "said"),
    [
        ("{p}_async:flow", "is async; guards and effects must be synchronous"),
        ("{p}_needs:flow", "importing '{p}_needs' failed: ModuleNotFoundError"),
        ("{p}:broken", "calling {p}:broken() failed: KeyError"),
    ],
)
def test_a_module_that_fails_is_an_error_line(project: str, reference: str, said: str) -> None:
    """The module (or the function) itself failing is exit 1 with one error line."""
    result = CliRunner().invoke(app, ["diagram", reference.format(p=project)])
    assert result.exit_code == 1, result.output
    assert said.format(p=project) in result.output
    assert "Traceback" not in result.output
