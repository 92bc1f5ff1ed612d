"""Which waiting pass the compute thread runs next: fair by identity, work-conserving, sybil-aware.

The compute thread never idles while a pass waits (:meth:`FairScheduler.pop` answers whenever anything is queued), so
no caller is ever refused or delayed for its share while the server has idle compute. Under contention the waiting
passes are served in weighted fair order (start-time fair queuing, the continuous form of deficit round robin): each
*flow* has a virtual tag, a pass of ``cost`` advances its flow's tag by ``cost / weight``, and the flow with the
smallest tag goes next. A flow that comes back after idling starts at the current virtual time, so idling banks no
credit.

Identities are free (a new libp2p id per call costs nothing), so they are not flows of their own until they have
earned it: an identity is *established* once it has been served ``establish_requests`` passes over at least
``establish_age`` seconds. Every identity not yet established shares one flow, the newcomers' (round robin among them
inside it), so a thousand fresh ids together weigh as much as one long-standing user. Growing ``k`` established
identities costs an attacker ``k * establish_requests`` passes served through that one shared flow and
``establish_age`` of patience; that is the remaining limit (docs/GOVERNANCE.md).

``--max-share-per-caller`` keeps its meaning as an order, never a refusal: a flow whose caller used more than that
share of the compute in the window goes after every flow within its share, and is still served at once when nobody
else waits.

Bounded: the flows with a pass queued (at most the compute queue's places), the finish tags of at most
``max_identities`` flows that emptied lately, and ``max_identities`` records of each kind (established and
newcomers kept apart, least recently served forgotten first, so a flood of fresh ids forgets only other
newcomers). Pure: no threads, no sockets; the clock is passed in.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

NEWCOMERS = ("newcomers",)  # the key of the flow every identity not yet established shares (not a str: no peer id)
MAX_IDENTITIES = 4096  # records kept of each kind
ESTABLISH_REQUESTS = 8
ESTABLISH_AGE_S = 60.0


@dataclass
class Job:
    """One pass waiting for the compute thread: whose it is, what it is counted at, and what it carries (``key``:
    passes with equal keys may be computed together; None runs alone)."""

    peer: str
    cost: float
    payload: Any = None
    key: Optional[Hashable] = None
    dropped: Callable[[], bool] = lambda: False  # its caller stopped waiting: skipped, never run
    size: int = 0  # positions (batch x length), for the bound on a merged pass
    resumed: bool = False  # a pass already under way (charged in full when it started): its next piece costs nothing


@dataclass
class Flow:
    tag: float = 0.0
    jobs: deque = field(default_factory=deque)  # an established identity's passes, in arrival order
    members: OrderedDict = field(default_factory=OrderedDict)  # the newcomers' flow: peer -> deque of its passes

    def __len__(self) -> int:
        return len(self.jobs) + sum(len(queue) for queue in self.members.values())


@dataclass
class Identity:
    first: float
    requests: int = 0


class FairScheduler:
    """Queued passes by flow, popped in weighted fair order (see the module doc). ``over_share(peer)`` says whether a
    caller is over ``--max-share-per-caller`` now (None: no cap)."""

    def __init__(self, establish_requests: int = ESTABLISH_REQUESTS, establish_age: float = ESTABLISH_AGE_S,
                 max_identities: int = MAX_IDENTITIES, over_share: Optional[Callable[[str], bool]] = None):
        if establish_requests < 0 or establish_age < 0 or max_identities < 1:
            raise ValueError("establish_requests and establish_age must be at least 0, max_identities at least 1")
        self.establish_requests, self.establish_age = establish_requests, establish_age
        self.max_identities, self.over_share = max_identities, over_share
        self.flows: dict[Hashable, Flow] = {}
        self.vtime = 0.0
        self.order = itertools.count()  # ties between equal tags go to the flow that became active first
        self.arrival: dict[Hashable, int] = {}
        # the finish tags of flows that emptied lately: a caller that sends its next pass as soon as its last is
        # answered restarts where it finished, not at the current virtual time (else it would be served again free)
        self.finished: OrderedDict[Hashable, float] = OrderedDict()
        self.established: OrderedDict[str, Identity] = OrderedDict()
        self.newcomers: OrderedDict[str, Identity] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return sum(len(flow) for flow in self.flows.values())

    # ----- identities ------------------------------------------------------------------------------
    def is_established(self, peer: str) -> bool:
        return peer in self.established

    def flow_key(self, peer: str) -> Hashable:
        return peer if peer in self.established else NEWCOMERS

    def served(self, peer: str, now: float) -> None:
        """Count a pass served for ``peer``: after enough of them over enough time it becomes established."""
        identity = self.established.pop(peer, None)
        if identity is not None:
            identity.requests += 1
            self._keep(self.established, peer, identity)
            return
        identity = self.newcomers.pop(peer, None) or Identity(first=now)
        identity.requests += 1
        if identity.requests >= self.establish_requests and now - identity.first >= self.establish_age:
            self._keep(self.established, peer, identity)
            self._regroup(peer)
        else:
            self._keep(self.newcomers, peer, identity)

    def _keep(self, records: OrderedDict, peer: str, identity: Identity) -> None:
        records[peer] = identity  # most recently served last
        while len(records) > self.max_identities:
            records.popitem(last=False)
            self.forgotten += 1

    def _regroup(self, peer: str) -> None:
        """A newcomer just established: its queued passes leave the newcomers' flow for a flow of its own."""
        pool = self.flows.get(NEWCOMERS)
        queue = pool.members.pop(peer, None) if pool is not None else None
        if not queue:
            return
        if not len(pool):
            self._drop_flow(NEWCOMERS)
        for job in queue:
            self._enqueue(peer, job)

    # ----- queue -----------------------------------------------------------------------------------
    def push(self, job: Job) -> None:
        self._enqueue(self.flow_key(job.peer), job)

    def resume(self, job: Job) -> None:
        """A pass that ran one piece and has more (a long pass runs in pieces between blocks, so a small one need not
        wait for all of it): back at the head of its caller's queue. It was charged in full when it started, so its
        flow's tag already stands behind the passes of callers that have had less; they go first."""
        job.resumed = True
        self._enqueue(self.flow_key(job.peer), job, first=True)

    def _enqueue(self, key: Hashable, job: Job, first: bool = False) -> None:
        flow = self.flows.get(key)
        if flow is None:  # (re)activated: no credit for the time it was idle, no discount on what it just had
            flow = self.flows[key] = Flow(tag=max(self.vtime, self.finished.pop(key, self.vtime)))
            self.arrival[key] = next(self.order)
        queue = flow.members.setdefault(job.peer, deque()) if key == NEWCOMERS else flow.jobs
        if first:
            queue.appendleft(job)
        else:
            queue.append(job)

    def pop(self, match: Optional[Callable[[Job], bool]] = None) -> Optional[Job]:
        """The next pass to run (None when nothing waits, or nothing that ``match`` accepts), its flow charged."""
        self._skip_dropped()
        candidates = [(key, flow) for key, flow in self.flows.items() if self._first(flow, match) is not None]
        if not candidates:
            return None
        contended = len(candidates) > 1  # a share orders callers only against others waiting
        key, flow = min(candidates, key=lambda item: (contended and self._demoted(item[0]), item[1].tag,
                                                      self.arrival[item[0]]))
        job = self._take(flow, match)
        self.vtime = max(self.vtime, flow.tag)
        flow.tag += 0.0 if job.resumed else job.cost  # each flow weighs 1; the newcomers' flow one, whatever its size
        if not len(flow):
            self._drop_flow(key)
        return job

    def _demoted(self, key: Hashable) -> bool:
        if self.over_share is None or key == NEWCOMERS:
            return False
        return self.over_share(key)

    @staticmethod
    def _queues(flow: Flow) -> list[deque]:
        return [flow.jobs] if not flow.members else list(flow.members.values())

    def _first(self, flow: Flow, match: Optional[Callable[[Job], bool]]) -> Optional[Job]:
        for queue in self._queues(flow):
            for job in queue:
                if match is None or match(job):
                    return job
        return None

    def _take(self, flow: Flow, match: Optional[Callable[[Job], bool]]) -> Job:
        """The first matching pass; among newcomers, of the first member that has one, which then goes last."""
        if not flow.members:
            job = self._first(flow, match)
            flow.jobs.remove(job)
            return job
        for peer, queue in flow.members.items():
            job = next((job for job in queue if match is None or match(job)), None)
            if job is not None:
                queue.remove(job)
                del flow.members[peer]
                if queue:
                    flow.members[peer] = queue  # round robin: its next pass waits for the other members' turn
                return job
        raise LookupError("no matching pass")  # callers check _first before

    def _skip_dropped(self) -> None:
        for key, flow in list(self.flows.items()):
            for queue in self._queues(flow):
                for job in [job for job in queue if job.dropped()]:
                    queue.remove(job)
            for peer in [peer for peer, queue in flow.members.items() if not queue]:
                del flow.members[peer]
            if not len(flow):
                self._drop_flow(key)

    def _drop_flow(self, key: Hashable) -> None:
        flow = self.flows.pop(key, None)
        self.arrival.pop(key, None)
        if flow is not None and flow.tag > self.vtime:
            self.finished.pop(key, None)
            self.finished[key] = flow.tag
            while len(self.finished) > self.max_identities or (self.finished and
                                                               next(iter(self.finished.values())) <= self.vtime):
                self.finished.popitem(last=False)  # the oldest first; one at or below the virtual time means nothing

    def info(self) -> dict:
        return {"queued": len(self), "flows": len(self.flows), "established": len(self.established),
                "newcomers": len(self.newcomers), "forgotten": self.forgotten}
