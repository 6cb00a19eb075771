"""Trace analysis: trace loading, TraceLens-compatible tables, cross-rank verdicts, reports.

Nothing under this package imports torch.distributed or the agent, so `distanom report`
runs on a laptop with no GPU.
"""
