"""CUDA graph loops as torch's documentation shows them, between eager steps, for
tests/gpu/test_graph_capture_gpu.py (training under distanom must go on as without it):

- `--mode whole`: eager steps; a few on a side stream (the warm-up a capture needs); one
  whole iteration (forward, backward, optimizer step) captured with `torch.cuda.graph`
  in its default `global` mode, where any thread's event query breaks the capture; the
  graph replayed on new data (`--stall-replay K`: the host sleeps before replay K);
  eager steps again.
- `--mode partial`: eager steps, then the model passed to `make_graphed_callables`
  (which refuses a module with forward hooks) and trained through its graphs, the
  optimizer step eager.

Prints the loss before, after the graph part and at the end.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("whole", "partial"), default="whole")
    parser.add_argument("--eager", type=int, default=40, help="eager steps before and after")
    parser.add_argument("--warmup", type=int, default=3, help="side-stream steps (whole)")
    parser.add_argument("--graph-steps", type=int, default=50)
    parser.add_argument("--stall-replay", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    weights = torch.randn(64, 1, device=device) / 8

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 64, device=device)
        return x, x @ weights

    def step(net: torch.nn.Module) -> torch.Tensor:
        x, y = batch()
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = step(model).item()
    for _ in range(args.eager - 1):
        step(model)
    if args.mode == "whole":
        static_x, static_y = batch()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(args.warmup):
                loss_fn(model(static_x), static_y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = loss_fn(model(static_x), static_y)
            static_loss.backward()
            optimizer.step()
        for replay in range(args.graph_steps):
            if replay == args.stall_replay:
                time.sleep(0.5)
            x, y = batch()
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
        middle = static_loss.item()
        optimizer.zero_grad(set_to_none=True)
        net = model
    else:
        sample = torch.randn(32, 64, device=device)
        net = torch.cuda.make_graphed_callables(model, (sample,))
        for _ in range(args.graph_steps):
            middle_loss = step(net)
        middle = middle_loss.item()
    for _ in range(args.eager):
        last = step(net)
    torch.cuda.synchronize()
    print(
        f"graph_train: {args.mode} graph, loss {first:.4f} -> {middle:.4f} -> {last.item():.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
