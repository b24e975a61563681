"""ClientRoutes: which API server process each request came from, and one loop turn's CoreOutputs cut per process.

With `--api-server-count N` the engine core serves N API server processes, each with its own output socket. A
command carries its sender's index; `add` remembers it for the request and its sequences, `split` cuts a
turn's message into N messages: the rows, finishes, logprobs and errors of each process's own requests, and to
every process the turn's shared fields (snapshot, step times and sizes, a step error), so each one's /metrics
gauges stay current. One API server (the default) never comes here: its messages go out whole."""

from __future__ import annotations

from dataclasses import dataclass

from .core_messages import CoreOutputs

_ROW_FIELDS = ("req_ids", "token_ids", "num_cached_tokens", "logprob", "rank", "topk_ids", "topk_logprobs")


@dataclass
class _Route:
    client: int
    child_ids: list[str]
    open_children: int


class ClientRoutes:
    """The core's record of which API server process each request (and its sequences) came from."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self._parents: dict[str, _Route] = {}
        self._child_parent: dict[str, str] = {}  # sequence id -> request id

    def add(self, parent_id: str, child_ids: list[str], client: int) -> None:
        self._parents[parent_id] = _Route(client, list(child_ids), len(child_ids))
        for cid in child_ids:
            self._child_parent[cid] = parent_id

    def client_of(self, parent_id: str) -> int | None:
        route = self._parents.get(parent_id)
        return None if route is None else route.client

    def forget(self, parent_id: str) -> None:
        """The request is over (aborted, failed, refused): its routes go."""
        route = self._parents.pop(parent_id, None)
        if route is not None:
            for cid in route.child_ids:
                self._child_parent.pop(cid, None)

    def __len__(self) -> int:
        return len(self._parents)

    def split(self, msg: CoreOutputs, utility_clients: list[int]) -> list[CoreOutputs]:
        """One message per client (index = client). utility_clients [len(msg.utility)]: who asked each call. The
        routes of requests that ended in this message are forgotten afterwards."""
        parts = [CoreOutputs(snapshot=msg.snapshot, step_started=msg.step_started, step_ended=msg.step_ended,
                             num_step_reqs=msg.num_step_reqs, num_step_tokens=msg.num_step_tokens,
                             step_error=msg.step_error) for _ in range(self.num_clients)]
        parent_of, routes = self._child_parent.get, self._parents

        def child(cid: str) -> int | None:  # the client of a sequence (None: nobody waits for it any more)
            route = routes.get(parent_of(cid, ""))
            return None if route is None else route.client

        if msg.req_ids:
            rows: list[list[int]] = [[] for _ in range(self.num_clients)]
            for r, cid in enumerate(msg.req_ids):
                c = child(cid)
                if c is not None:  # None: a sequence no process waits for any more (aborted): dropped
                    rows[c].append(r)
            for part, picked in zip(parts, rows):
                if picked:
                    for name in _ROW_FIELDS:
                        values = getattr(msg, name)
                        if values:
                            setattr(part, name, [values[r] for r in picked])
        for cid, data in msg.full_logprobs.items():
            if (c := child(cid)) is not None:
                parts[c].full_logprobs[cid] = data
        for item in msg.prompt_logprobs:
            if (c := child(item.request_id)) is not None:
                parts[c].prompt_logprobs.append(item)
        for item in msg.routed_experts:
            if (c := child(item.request_id)) is not None:
                parts[c].routed_experts.append(item)
        ended: list[str] = []
        for item in msg.finished:
            if (c := child(item[0])) is not None:
                parts[c].finished.append(item)
                ended.append(item[0])
        for parent_id, started in msg.scheduled.items():
            if (c := self.client_of(parent_id)) is not None:
                parts[c].scheduled[parent_id] = started
        for name in ("failed", "asleep"):
            for parent_id in getattr(msg, name):
                if (c := self.client_of(parent_id)) is not None:
                    getattr(parts[c], name).append(parent_id)
        for item in msg.rejected:
            if (c := self.client_of(item[0])) is not None:
                parts[c].rejected.append(item)
        for c, result in zip(utility_clients, msg.utility):
            parts[c].utility.append(result)
        self._finish(ended, [*msg.failed, *msg.asleep, *(p for p, _ in msg.rejected)])
        return parts

    def _finish(self, children: list[str], parents: list[str]) -> None:
        """Sequences that finished (their request goes with its last one) and requests that ended."""
        for parent_id in parents:
            self.forget(parent_id)
        for cid in children:
            parent_id = self._child_parent.pop(cid, None)
            route = self._parents.get(parent_id) if parent_id is not None else None
            if route is not None:
                route.open_children -= 1
                if route.open_children <= 0:
                    del self._parents[parent_id]
