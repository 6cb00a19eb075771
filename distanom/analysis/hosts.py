"""`distanom hosts`: the hosts (and GPUs) that keep being blamed, over many runs.

Tallies what `distanom.analysis.fleet_runs.scan_runs` read: every `Implication` (a slow
step's culprit, a straggler, a hang's culprit) counts for its host and for its GPU,
(host, local rank). A host is ranked by the runs that blamed it at least once, then by
the share of its runs that did, then by how many times it was blamed: a run that blamed
one rank at a thousand steps is one run, so one bad job does not outweigh a host that
is blamed in run after run. Each row keeps its causes and its evidence (run, kind,
rank, steps). Rendered as a short text table (most suspicious first) or JSON, printed
by `distanom.cli`; nothing is written. No torch here.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from distanom.analysis.fleet_runs import KINDS, Implication, RunImplications, Scan

__all__ = ["Suspect", "Suspects", "hosts_json", "hosts_text", "rank_suspects"]

MAX_EVIDENCE = 50  # evidence entries kept per host or GPU in the JSON
MAX_STEPS_SHOWN = 20  # steps listed per evidence entry
TEXT_EVIDENCE = 3  # evidence entries the text shows per row


@dataclass
class Suspect:
    """One host, or one GPU (host, local rank), and what the runs said about it."""

    host: str
    local_rank: int | None  # None: the whole host
    runs: int = 0  # runs it took part in
    blamed_runs: int = 0  # runs that named it at least once
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # by kind
    causes: collections.Counter[str] = field(default_factory=collections.Counter)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    evidence_left_out: int = 0

    @property
    def name(self) -> str:
        """`host`, or `host/local rank` for a GPU."""
        return self.host if self.local_rank is None else f"{self.host}/{self.local_rank}"

    @property
    def blamed(self) -> int:
        """Times it was named, all kinds."""
        return sum(self.counts.values())

    @property
    def share(self) -> float:
        """The share of its runs that named it."""
        return self.blamed_runs / self.runs if self.runs else 0.0

    def as_json(self) -> dict[str, Any]:
        """JSON-ready."""
        body: dict[str, Any] = {"host": self.host}
        if self.local_rank is not None:
            body["local_rank"] = self.local_rank
        body.update(
            runs=self.runs,
            blamed_runs=self.blamed_runs,
            blamed_share=round(self.share, 4),
            blamed=self.blamed,
            **{kind: self.counts[kind] for kind in KINDS},
            causes=dict(self.causes.most_common()),
            evidence=self.evidence,
            evidence_left_out=self.evidence_left_out,
        )
        return body


@dataclass
class Suspects:
    """Hosts and GPUs, most suspicious first, and the scan's problems."""

    scan: Scan
    hosts: list[Suspect]
    gpus: list[Suspect]


def rank_suspects(scan: Scan) -> Suspects:
    """Tally every run's implications by host and by GPU and order them."""
    hosts: dict[Hashable, Suspect] = {}
    gpus: dict[Hashable, Suspect] = {}
    for run in scan.runs:
        for host in set(run.hosts):
            _suspect(hosts, host, None).runs += 1
        local: collections.Counter[str] = collections.Counter()
        for host in run.hosts:  # local ranks of the run's GPUs: their place on the host
            _suspect(gpus, host, local[host]).runs += 1
            local[host] += 1
        _fold(hosts, run, lambda found: (found.host, None))
        _fold(
            gpus,
            run,
            lambda found: None if found.local_rank is None else (found.host, found.local_rank),
        )
    return Suspects(scan, _ordered(hosts.values()), _ordered(gpus.values()))


def _suspect(table: dict[Hashable, Suspect], host: str, local_rank: int | None) -> Suspect:
    key = (host, local_rank)
    if key not in table:
        table[key] = Suspect(host, local_rank)
    return table[key]


def _fold(table: dict[Hashable, Suspect], run: RunImplications, key_of: Any) -> None:
    """One run's implications into `table`: counts and causes per implication, one
    blamed run per suspect, evidence grouped by (kind, rank, cause) with its steps."""
    grouped: dict[tuple[Any, ...], list[Implication]] = {}
    for found in run.found:
        key = key_of(found)
        if key is not None:
            grouped.setdefault((*key, found.kind, found.rank, found.cause), []).append(found)
    blamed: set[tuple[str, int | None]] = set()
    for (host, local_rank, kind, rank, cause), items in grouped.items():
        suspect = _suspect(table, host, local_rank)
        steps = sorted({f.step for f in items if f.step is not None})
        suspect.counts[kind] += len(items)
        suspect.causes[cause] += len(items)
        if (host, local_rank) not in blamed:
            blamed.add((host, local_rank))
            suspect.blamed_runs += 1
        if len(suspect.evidence) >= MAX_EVIDENCE:
            suspect.evidence_left_out += 1
            continue
        suspect.evidence.append(
            {
                "run": run.run_id,
                "kind": kind,
                "rank": rank,
                "cause": cause,
                "count": len(items),
                "steps": steps[:MAX_STEPS_SHOWN],
            }
        )


def _ordered(suspects: Iterable[Suspect]) -> list[Suspect]:
    return sorted(suspects, key=lambda s: (-s.blamed_runs, -s.share, -s.blamed, s.name))


def hosts_json(suspects: Suspects) -> dict[str, Any]:
    """`distanom hosts --json`."""
    scan = suspects.scan
    return {
        "folders": scan.folders,
        "runs": len(scan.runs),
        "hosts": [s.as_json() for s in suspects.hosts],
        "gpus": [s.as_json() for s in suspects.gpus if s.blamed_runs],
        "problems": scan.problems,
    }


def hosts_text(suspects: Suspects, top: int = 10, problems_shown: int = 10) -> str:
    """The table people read: the `top` most suspicious hosts and GPUs, with evidence."""
    scan = suspects.scan
    lines = [
        f"distanom hosts: {len(scan.runs)} runs in {', '.join(scan.folders)}"
        f" ({len(suspects.hosts)} hosts, {len(scan.problems)} problems)"
    ]
    for title, rows in (("hosts", suspects.hosts), ("GPUs (host/local rank)", suspects.gpus)):
        blamed = [s for s in rows if s.blamed_runs]
        lines.append("")
        if not blamed:
            lines.append(f"{title}: none blamed in these runs")
            continue
        lines.append(f"{title}, most often blamed first:")
        lines += _table(blamed[:top])
        if len(blamed) > top:
            lines.append(f"  ... {len(blamed) - top} more blamed (--top N, or --json)")
    if scan.problems:
        lines += ["", "problems:"]
        lines += [f"  {problem}" for problem in scan.problems[:problems_shown]]
        if len(scan.problems) > problems_shown:
            lines.append(f"  ... {len(scan.problems) - problems_shown} more (--json)")
    return "\n".join(lines) + "\n"


def _table(rows: list[Suspect]) -> list[str]:
    header = ("name", "runs", "blamed in", "culprit", "straggler", "hang", "causes")
    cells = [
        (
            row.name,
            str(row.runs),
            f"{row.blamed_runs} ({row.share:.0%})",
            str(row.counts["culprit"]),
            str(row.counts["straggler"]),
            str(row.counts["hang"]),
            ", ".join(f"{cause} {n}" for cause, n in row.causes.most_common(4)),
        )
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header) - 1)]
    out = []
    for index, cell in enumerate([header, *cells]):
        padded = [c.ljust(w) for c, w in zip(cell[:-1], widths, strict=True)]
        out.append("  " + "  ".join([*padded, cell[-1]]))
        if index:
            out.append("    " + _evidence_line(rows[index - 1]))
    return out


def _evidence_line(row: Suspect) -> str:
    parts = []
    for entry in row.evidence[:TEXT_EVIDENCE]:
        steps = entry["steps"]
        where = (
            f"step{'s' if len(steps) > 1 else ''} {','.join(map(str, steps[:5]))}"
            + ("..." if len(steps) > 5 else "")
            if steps
            else "no step"
        )
        who = f"rank {entry['rank']}" if entry["rank"] is not None else "node"
        parts.append(f"{entry['run']} {where} ({entry['kind']}, {who}, {entry['cause']})")
    more = len(row.evidence) + row.evidence_left_out - TEXT_EVIDENCE
    return "e.g. " + "; ".join(parts) + (f"; +{more} more" if more > 0 else "")
