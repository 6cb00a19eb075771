"""Rank 0's desk for capture requests: on-demand ones from the run directory, and the
agent's own (a straggler worth one trace on every rank).

Reads requests/ (`distanom.records.requests`: bounded, validated, a hostile file only
skipped), numbers each request, and offers one at a time to the next consensus round,
which carries it in rank 0's row to every rank (`distanom.consensus.CaptureRequest`).
Once a round has carried it, the desk answers the request file with the steps that
were scheduled. Used by the control thread only (`distanom.control_loop`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distanom.consensus import CaptureRequest
from distanom.detect import CaptureDecision
from distanom.errors import CaptureRequestError
from distanom.records.requests import (
    Accepted,
    Refused,
    answer,
    pending_requests,
    validate_request,
)
from distanom.rundir import RunDir


class RequestDesk:
    """Numbers, offers and answers capture requests (see the module docstring)."""

    def __init__(self, world_size: int, warn_once: Callable[..., Any]) -> None:
        self.world_size = world_size
        self._warn_once = warn_once
        self._request_ids: dict[int, str] = {}  # number -> request file id
        self._next_number = 1
        self.offered: tuple[CaptureRequest, str] | None = None  # for the next round

    def busy(self) -> bool:
        """Whether a request waits for a round to carry it."""
        return self.offered is not None

    def offer_own(self, n_steps: int, label: str) -> int:
        """Offer a request of distanom's own (no file to answer); returns its number."""
        number = self._take_number()
        self.offered = (CaptureRequest(number, n_steps), label)
        return number

    def carried(self) -> None:
        """The offered request went out in a round."""
        self.offered = None

    def poll(self, run: RunDir | None) -> None:
        """Offer the next valid pending request of the run directory, if none is offered;
        refuses invalid ones in their answer file."""
        if run is None or self.offered is not None:
            return
        try:  # a hostile request file must never reach the round loop (capture stays on)
            self._take_request(run)
        except Exception as err:
            self._warn_once("requests", "requests/: %s; request skipped", err)

    def _take_number(self) -> int:
        number = self._next_number
        self._next_number += 1
        return number

    def _take_request(self, run: RunDir) -> None:
        known = set(self._request_ids.values())
        for request in pending_requests(run, skip=known):
            if request.request_id in known:
                continue
            try:
                validate_request(request.n_steps, request.ranges, self.world_size)
            except CaptureRequestError as err:
                answer(run, request.request_id, Refused(str(err)))
                continue
            number = self._take_number()
            self._request_ids[number] = request.request_id
            carried = CaptureRequest(number, request.n_steps, request.ranges)
            self.offered = (carried, request.request_id)
            return

    def answer(
        self, run: RunDir | None, request: CaptureRequest | None, decisions: list[CaptureDecision]
    ) -> None:
        """Answer the file of a request a round carried, with the steps scheduled for it."""
        if request is None or run is None:
            return
        request_id = self._request_ids.get(request.number)
        if request_id is None:
            return  # one of distanom's own
        steps = [d.step for d in decisions if d.request_id == str(request.number)]
        ranks = request.ranks(self.world_size)
        accepted = Accepted(
            request=str(request.number),
            steps=steps,
            ranks=list(ranks) if ranks is not None else "all",
            world_size=self.world_size,
        )
        try:
            answer(run, request_id, accepted)
        except OSError as err:
            self._warn_once("answer", "requests/: answer not written (%s)", err)
