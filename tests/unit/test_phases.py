"""Step phases on the training thread (`distanom.phases`): the split of a step's time by
its marks, and the marks a real CPU loop sets (batch fetch, outermost forward, backward,
optimizer step), through the agent as a script runs under it."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from distanom.agent import Agent
from distanom.config import load_config
from distanom.phase_split import (
    _BWD_END,
    _FWD_END,
    _FWD_START,
    _OPT_START,
    BACKWARD,
    DATA,
    FORWARD,
    OPTIMIZER,
    TAIL,
    split_gpu,
    split_parts,
)
from distanom.phases import PhaseMarks
from distanom.records.steps import PHASE_COLUMNS
from distanom.world import WorldInfo


def test_a_plain_loop_splits_into_its_five_parts() -> None:
    marks = [(_FWD_START, 3.0), (_FWD_END, 7.0), (_BWD_END, 15.0), (_OPT_START, 16.0)]
    parts = split_parts(marks, 0.0, 20.0)
    assert parts == [3.0, 4.0, 8.0, 1.0, 4.0]
    assert sum(parts) == 20.0


def test_lightning_runs_forward_and_backward_inside_the_optimizer_step() -> None:
    # optimizer.step(closure): the closure's forward and backward, then the update
    marks = [(_OPT_START, 2.0), (_FWD_START, 2.5), (_FWD_END, 6.0), (_BWD_END, 12.0)]
    parts = split_parts(marks, 0.0, 15.0)
    assert parts[DATA] == 2.0 and parts[FORWARD] == 3.5 and parts[BACKWARD] == 6.0
    assert parts[TAIL] == 0.0 and parts[OPTIMIZER] == 0.5 + 3.0


def test_micro_batches_sum_per_phase_and_the_fetch_between_them_is_data() -> None:
    marks = [
        (_FWD_START, 1.0), (_FWD_END, 2.0), (_BWD_END, 4.0),  # micro-batch 1
        (_FWD_START, 5.0), (_FWD_END, 6.0), (_BWD_END, 8.0),  # micro-batch 2
        (_OPT_START, 9.0),
    ]  # fmt: skip
    parts = split_parts(marks, 0.0, 10.0)
    assert parts == [2.0, 2.0, 4.0, 1.0, 1.0]


class SlowItems(Dataset[torch.Tensor]):
    """Items whose fetch sleeps `sleep_s` at the indices in `slow`."""

    def __init__(self, slow: set[int], sleep_s: float) -> None:
        self.slow, self.sleep_s = slow, sleep_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in self.slow:
            time.sleep(self.sleep_s)
        return torch.randn(8)


class SleepySGD(torch.optim.SGD):
    """An optimizer whose own step sleeps at chosen calls (a slow optimizer step)."""

    def __init__(self, params: object, slow: set[int], sleep_s: float) -> None:
        super().__init__(params, lr=0.01)  # type: ignore[arg-type]
        self.calls, self.slow, self.sleep_s = 0, slow, sleep_s

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if self.calls in self.slow:
            time.sleep(self.sleep_s)
        self.calls += 1
        super().step()


class Net(torch.nn.Module):
    def __init__(self, busy_at: set[int]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)
        self.calls, self.busy_at = 0, busy_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls in self.busy_at:
            until = time.perf_counter() + 0.05
            while time.perf_counter() < until:  # a busy forward: Python on the CPU
                pass
        self.calls += 1
        return self.layer(x)


def _rows(agent: Agent) -> dict[int, dict[str, float]]:
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        return {
            int(row["step"]): {k: float(row[k]) for k in PHASE_COLUMNS}
            for row in csv.DictReader(handle)
        }


def test_a_loop_under_the_agent_records_each_phase_where_its_fault_was(tmp_path: Path) -> None:
    """One fault per phase at its own step: a fetch that sleeps (step 4), a busy forward
    (step 6), a sleep between backward and the optimizer step (step 8), a sleep inside the
    optimizer's step (step 10). Each lands in its part of that step's row alone."""
    config = load_config(None, ["tracer.backend=none", "detect.warmup_steps=0"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    try:
        model = Net(busy_at={6})
        loss_fn = torch.nn.MSELoss()  # an outermost module too: shorter, so not the model
        optimizer = SleepySGD(model.parameters(), slow={10}, sleep_s=0.05)
        loader = DataLoader(SlowItems({4 * 4}, 0.05), batch_size=4)  # batch 4's first item
        for step, batch in enumerate(loader):
            if step >= 12:
                break
            loss = loss_fn(model(batch), torch.zeros(4, 2))
            loss.backward()
            if step == 8:
                time.sleep(0.05)  # between backward and optimizer.step()
            optimizer.step()
            optimizer.zero_grad()
        phases = agent.boundaries.phases
        assert phases.model_name == "Net"
    finally:
        agent.close()
    rows = _rows(agent)
    assert all(math.isfinite(rows[s]["forward_ms"]) for s in range(1, 12)), rows
    assert all(math.isnan(rows[s]["gpu_backward_ms"]) for s in range(1, 12))  # no CUDA here

    def quiet(step: int, column: str) -> bool:
        return rows[step][column] < 30

    assert rows[4]["fetch_ms"] >= 45 and rows[4]["data_ms"] >= 45, rows[4]
    assert quiet(4, "forward_ms") and quiet(4, "optimizer_ms") and quiet(4, "tail_ms")
    assert rows[6]["forward_ms"] >= 45 and quiet(6, "data_ms") and quiet(6, "fetch_ms"), rows[6]
    assert rows[8]["tail_ms"] >= 45 and quiet(8, "forward_ms") and quiet(8, "optimizer_ms")
    assert rows[10]["optimizer_ms"] >= 45 and quiet(10, "tail_ms"), rows[10]
    for step in (5, 7, 9, 11):  # healthy steps: nothing over 30 ms anywhere
        assert all(quiet(step, column) for column in PHASE_COLUMNS[:6]), rows[step]


def test_the_gpu_parts_split_at_the_forward_and_backward_ends() -> None:
    # micro-batches: (data+forward) 2, backward 3, (data+forward) 2, backward 3, after 1
    timed = [(_FWD_END, 2.0), (_BWD_END, 5.0), (_FWD_END, 7.0), (_BWD_END, 10.0)]
    assert split_gpu(timed, 11.0) == (4.0, 6.0, 1.0)
    assert split_gpu([(_FWD_END, 2.0)], 3.0) == (2.0, 1.0, 0.0)  # no backward: forward only


def test_hooks_are_undone_at_close() -> None:
    from torch.utils.data import dataloader

    before_next = dataloader._BaseDataLoaderIter.__dict__["__next__"]
    before_backward = torch.autograd.backward
    marks = PhaseMarks()
    marks.install()
    assert torch.autograd.backward is not before_backward
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2))
    marks.step_ended(0, time.perf_counter_ns())
    assert marks.model_name == "Linear" and not marks._global
    marks.uninstall()
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"] is before_next
    assert torch.autograd.backward is before_backward
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_loop_without_modules_gets_its_optimizer_phase_only() -> None:
    marks = PhaseMarks()
    marks.install()
    try:
        weight = torch.zeros(2, requires_grad=True)
        for step in range(4):
            (weight * 2).sum().backward()
            marks.optimizer_started()
            marks.step_ended(step, time.perf_counter_ns())
        host, _fetch, _gpu = marks.take(3)
        assert all(math.isnan(v) for v in host[:4]) and host[OPTIMIZER] >= 0
        assert "not told apart" in marks.note
    finally:
        marks.uninstall()
