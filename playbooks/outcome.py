"""The one shape every playbook shares: its outcome, its progress events, its confirm callable.

    run(inventory, session, options, confirm, on_event) -> Outcome

- `options`: one frozen dataclass per playbook (what the command's flags asked).
- `confirm(question) -> bool`: given by the CLI (a prompt, or --yes); a read-only playbook
  never calls it.
- `on_event(event)`: receives typed progress events (`Progress`: a line of what is happening;
  `NodeDone`: one node's gather finished, for a progress bar); the CLI renders them, the
  playbook prints nothing.
- the result is an `Outcome`: `exit_code` follows the CLI contract (0 done / nothing to do,
  1 warnings only, 2 anything failed, refused, not confirmed or stopped by an error) and
  `to_dict()` is the command's JSON document. Per node or step a playbook speaks the Ansible
  vocabulary: ok / changed / failed / skipped / unreachable (`STEP_STATUSES`); `step_exit_code`
  maps those to the exit code.

Outcomes whose report is a document filled as they go (deploy, undeploy, tune) are `DocOutcome`s,
created by the caller so that an error midway still leaves a record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

from cluster.base.results import (CHANGED, EXIT_FAIL, EXIT_OK, EXIT_WARN, FAILED, OK, SKIPPED,
                             STEP_STATUSES, UNREACHABLE)

__all__ = ["CHANGED", "EXIT_FAIL", "EXIT_OK", "EXIT_WARN", "FAILED", "OK", "SKIPPED",
           "STEP_STATUSES", "UNREACHABLE", "Progress", "NodeDone", "Event", "OnEvent", "Confirm",
           "ignore", "lines_to", "never_confirm", "step_exit_code", "Outcome", "DocOutcome"]


@dataclass(frozen=True)
class Progress:
    """A line saying what the playbook is doing now ("draining gpu02")."""

    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class NodeDone:
    """One node's gather finished (`result`: its CommandResult; `ok` False counts a failure)."""

    result: Any

    @property
    def ok(self) -> bool:
        return getattr(self.result, "ok", True) is not False


Event = Union[Progress, NodeDone]
OnEvent = Callable[[Event], None]
Confirm = Callable[[str], bool]


def ignore(_event: Event) -> None:
    """The default on_event: progress nobody renders."""


def lines_to(on_event: OnEvent) -> Callable[[str], None]:
    """The callable the library's helpers take for progress lines, as typed Progress events."""
    return lambda line: on_event(Progress(line))


def never_confirm(question: str) -> bool:
    """The confirm of a read-only playbook's callers: asking anything is a bug."""
    raise AssertionError(f"a read-only playbook asked: {question}")


def step_exit_code(statuses: Iterable[str]) -> int:
    """2 when any step failed or its node was unreachable, else 0."""
    return EXIT_FAIL if any(s in (FAILED, UNREACHABLE) for s in statuses) else EXIT_OK


class Outcome:
    """The base of every playbook's outcome: `exit_code` (0/1/2, the CLI's) and `to_dict()`.

    A plain base (not a dataclass) so each outcome keeps its own dataclass fields in its own
    order; it holds the behaviour they share."""

    exit_code: int
    stopped: str | None

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every outcome defines it
        raise NotImplementedError

    def stop(self, why: str, code: int = EXIT_FAIL):
        """The playbook stops here (dry run: code 0; refused / not confirmed: 2)."""
        self.stopped, self.exit_code = why, code
        return self

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK


@dataclass
class DocOutcome(Outcome):
    """The report's fields as they are learned; `exit_code` follows the CLI contract (2 until
    the playbook says otherwise)."""

    doc: dict[str, Any] = field(default_factory=dict)
    exit_code: int = EXIT_FAIL
    stopped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.doc)
