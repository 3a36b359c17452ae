"""The outcome shape of the playbooks whose report is a document filled as they go (deploy,
undeploy, tune): the caller creates it first, so an error midway still leaves a record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DocOutcome:
    """The report's fields as they are learned; `exit_code` follows the CLI contract (2 until
    the playbook says otherwise)."""

    doc: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 2

    def to_dict(self) -> dict[str, Any]:
        return dict(self.doc)
