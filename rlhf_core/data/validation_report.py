"""The result of validating preference data: one `CheckResult` per check, gathered in a
`ValidationReport` that renders as a dict (JSON), a Markdown table, or one line per failure.

The report also says how the file was read when that is worth knowing (a UTF-8 byte-order
mark, CRLF line ends) and names the columns outside the contract, which training never reads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """The outcome of one expectation, in terms a person can act on."""

    name: str  # stable, e.g. "chosen_differs_from_rejected"
    expectation: str  # GX expectation type
    column: str | None
    success: bool
    expected: str
    observed: str  # e.g. "3 of 500 rows (0.6%)"
    unexpected_count: int | None = None  # offending rows, for row-level checks
    lines: list[int] = field(default_factory=list)  # first offending line numbers
    sample: list[dict[str, Any]] = field(default_factory=list)  # first offending rows
    dataset: str = "preferences"  # or "eval"
    problem: str = ""  # what is wrong, e.g. "2 rows where chosen == rejected"

    def message(self) -> str:
        """One line naming the check, the problem and the offending lines."""
        text = f"{self.name}: {self.problem or f'expected {self.expected}, observed {self.observed}'}"
        if self.lines:
            where = ("eval " if self.dataset == "eval" else "") + ("line" if len(self.lines) == 1 else "lines")
            listed = ", ".join(str(n) for n in self.lines)
            more = (self.unexpected_count or len(self.lines)) - len(self.lines)
            text += f" ({where} {listed}{f', … +{more} more' if more > 0 else ''})"
        return text


@dataclass
class ValidationReport:
    """All checks of one validation; `success` only if every check that ran passed."""

    checks: list[CheckResult]
    num_rows: int
    eval_rows: int | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # check name -> why it did not run
    extra_columns: list[str] = field(default_factory=list)  # outside the contract: never read by training
    read_notes: list[str] = field(default_factory=list)  # how the file was read, e.g. "CRLF line ends"

    @property
    def success(self) -> bool:
        return all(c.success for c in self.checks)

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.success]

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; ran: {', '.join(c.name for c in self.checks)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "num_rows": self.num_rows,
            "eval_rows": self.eval_rows,
            "checks": [asdict(c) for c in self.checks],
            "skipped": dict(self.skipped),
            "extra_columns": list(self.extra_columns),
            "read_notes": list(self.read_notes),
        }

    def failure_message(self) -> str:
        return "\n".join(c.message() for c in self.failed)

    def to_markdown(self) -> str:
        n_failed = len(self.failed)
        verdict = "✅ passed" if self.success else f"❌ {n_failed} of {len(self.checks)} checks failed"
        rows = f"{self.num_rows} rows" + (f", eval set {self.eval_rows} rows" if self.eval_rows is not None else "")
        out = [f"### Preference data validation: {verdict} ({rows})", ""]
        out += ["| check | result | expected | observed |", "|---|---|---|---|"]
        for c in self.checks:
            mark = "✅" if c.success else "❌"
            out.append(f"| `{c.name}` | {mark} | {_cell(c.expected)} | {_cell(c.observed)} |")
        if self.skipped:
            out += ["", "Skipped: " + "; ".join(f"`{k}` ({v})" for k, v in self.skipped.items())]
        if self.extra_columns:
            out += ["", "Extra columns, not used in training: " + ", ".join(f"`{c}`" for c in self.extra_columns)]
        if self.read_notes:
            out += ["", "Read with: " + "; ".join(self.read_notes)]
        for c in self.failed:
            out += ["", f"#### ❌ `{c.name}`", "", _cell(c.message())]
            if c.sample:
                cols = list(c.sample[0])
                out += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                out += ["| " + " | ".join(_cell(r.get(k)) for k in cols) + " |" for r in c.sample]
        return "\n".join(out) + "\n"


def _cell(value: Any) -> str:
    """A value as a Markdown table cell: visible whitespace, no pipes or newlines."""
    if value is None:
        return "*null*"
    text = str(value)
    if not text.strip():
        return f"`{text!r}`"
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", "↵")
