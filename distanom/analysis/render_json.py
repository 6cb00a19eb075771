"""The report as JSON: `distanom report --json` and each capture's summary.json.

Both are contracts for machines: keys, order and values stay as they are (a golden
test holds them). Reads only the model (`distanom.analysis.model`).
"""

from __future__ import annotations

from typing import Any

from distanom.analysis.anomaly_classes import anomaly_classes, recurrence_json, recurring
from distanom.analysis.model import Capture, KernelDiff, RankEntry, Report
from distanom.analysis.tables_io import timeline_json

__all__ = ["capture_json", "kernel_diff_json", "report_json", "summary_json"]


def report_json(report: Report) -> dict[str, Any]:
    """The whole report as `distanom report --json` prints it."""
    facts, steps, state, cost = (
        report.facts,
        report.steps,
        report.capture_state,
        report.capture_cost,
    )
    found = recurring(report.anomalies, report.detect_config)
    body = {
        "run_id": facts.run_id,
        "run_dir": facts.run_dir,
        "world_size": facts.world_size,
        "hosts": facts.hosts,
        "state": facts.state,
        "started_at": facts.started_at,
        "torch": facts.torch,
        "argv": facts.argv,
        "steps": {
            "count": steps.count,
            "last": steps.last,
            "median_ms": steps.median_ms,
            "threshold_ms": steps.threshold_ms,
            "multiplier": steps.multiplier,
            "detector_median_ms": steps.detector_median_ms,
            "optimizer_skipped": steps.optimizer_skipped,
        },
        "tracer": report.tracer,
        "detector": report.detector,
        "agent_cost": report.agent_cost,
        "episodes": report.episodes,
        "capture_state": {
            "written": state.written,
            "skipped_disk": state.skipped_disk,
            "missed": state.missed,
            "capture_off": state.capture_off,
            "consensus_error": state.consensus_error,
        },
        "captures": [capture_json(capture) for capture in report.captures],
        "lost_time": report.lost_time.as_json() if report.lost_time is not None else None,
        "anomalies": [anomaly.as_json() for anomaly in report.anomalies],
        "anomaly_classes": [
            counts.as_json()
            for counts in anomaly_classes(report.anomalies, report.detect_config, found)
        ],
        "recurrences": [recurrence_json(r) for r in found],
        "stragglers": list(report.stragglers),
        "earlier_stragglers": list(report.earlier_stragglers),
        "drift": report.drift,
        "capture_cost": None
        if cost is None
        else {
            "files": cost.files,
            "median_ms": cost.median_ms,
            "max_ms": cost.max_ms,
            "parts_median_ms": cost.parts_median_ms,
        },
        "problems": list(report.problems),
        "hangs": [hang.as_json() for hang in report.hangs],
    }
    return _with_nodes(body, report) if report.facts.node_of else body


def _with_nodes(body: dict[str, Any], report: Report) -> dict[str, Any]:
    """The report naming ranks by node (runs that recorded their nodes): `nodes` (each
    node's host and ranks, local rank i at place i), `copies` where the run came in
    several, and the node number (torchrun's GROUP_RANK) beside each culprit rank and
    each capture's rank entries: `culprit_node_rank`, `node_rank` (a verdict's
    `culprit_node` is the host whose ranks are all the culprits)."""
    facts = report.facts
    node_of = facts.node_of
    body["nodes"] = {
        str(node): {"host": facts.node_hosts.get(node), "ranks": ranks}
        for node, ranks in facts.node_ranks().items()
    }
    if facts.copies:
        body["copies"] = list(facts.copies)
    for capture in body["captures"]:
        culprit = capture["culprit_rank"]
        capture["culprit_node_rank"] = None if culprit is None else node_of.get(culprit)
        for rank, entry in capture["ranks"].items():
            entry["node_rank"] = node_of.get(int(rank))
    for anomaly in body["anomalies"]:
        verdict = anomaly["verdict"]
        culprit = verdict["culprit_rank"]
        verdict["culprit_node_rank"] = None if culprit is None else node_of.get(culprit)
    return body


def _rank_json(entry: RankEntry) -> dict[str, Any]:
    body: dict[str, Any] = {
        "trace": entry.trace,
        "host": entry.host,
        "bytes": entry.bytes,
        "tracer": entry.tracer,
        "tracer_stats": entry.tracer_stats,
    }
    if entry.timeline is not None:
        key = "gpu_timeline" if entry.timeline_kind == "gpu" else "host_timeline"
        body[key] = timeline_json(entry.timeline)
        body["timeline_kind"] = entry.timeline_kind
    if entry.outside_ms is not None:
        body["outside_ms"] = entry.outside_ms
    if entry.run_dir is not None:  # another node's copy of the run holds this trace
        body["run_dir"] = entry.run_dir
    return body


def kernel_diff_json(diff: KernelDiff) -> dict[str, Any]:
    """A capture's kernel diff as JSON (`reference_step`, `ranks`, or a `note`)."""
    if diff.reference_step is None:
        return {"reference_step": None, "note": diff.note, "ranks": {}}
    return {
        "reference_step": diff.reference_step,
        "ranks": {str(rank): change.as_json() for rank, change in diff.ranks.items()},
    }


def _gc_json(capture: Capture) -> dict[str, Any]:
    return {
        str(rank): {"ms": pause.ms, "generation": pause.generation}
        for rank, pause in capture.python_gc.items()
    }


def capture_json(capture: Capture) -> dict[str, Any]:
    """One capture as it appears in the report's `captures` list."""
    body: dict[str, Any] = {
        "step": capture.step,
        "kinds": capture.kinds,
        "step_ms": capture.step_ms,
        "median_ms": capture.median_ms,
        "threshold_ms": capture.threshold_ms,
        "ratio": capture.ratio,
        "slowest_rank": capture.slowest_rank,  # deprecated: longest_step_rank (one version)
        "longest_step_rank": capture.slowest_rank,
        "culprit_rank": capture.verdict.culprit_rank,
        "optimizer_step_skipped": capture.optimizer_skipped,
        "request": capture.request,
        "ranks": {str(rank): _rank_json(entry) for rank, entry in capture.ranks.items()},
        "missing_ranks": capture.missing_ranks,
    }
    if capture.python_gc:
        body["python_gc"] = _gc_json(capture)
    body["verdict"] = capture.verdict.as_json()
    body["kernel_diff"] = kernel_diff_json(capture.kernel_diff)
    body["merged_trace"] = capture.merged_trace
    body["unreadable_ranks"] = capture.unreadable_ranks
    return body


def summary_json(capture: Capture) -> dict[str, Any]:
    """captures/step_<N>/summary.json: all ranks of one capture side by side."""
    return {
        "step": capture.step,
        "kinds": capture.kinds,
        "step_ms": capture.step_ms,
        "ratio": capture.ratio,
        "missing_ranks": capture.missing_ranks,
        "unreadable_ranks": capture.unreadable_ranks,
        "ranks": {
            str(rank): {
                "host": entry.host,
                "breakdown_ms": entry.breakdown(),
                "outside_ms": entry.outside_ms,
            }
            for rank, entry in capture.ranks.items()
        },
        "verdict": capture.verdict.as_json(),
        "kernel_diff": kernel_diff_json(capture.kernel_diff),
        "merged_trace": capture.merged_trace,
        "python_gc": _gc_json(capture),
    }
