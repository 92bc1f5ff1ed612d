"""The trainer's settings (plain values: the command declares its options from them without loading torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from swarm.adapters.kinds import LORA

FALLBACK_MODEL = "addition"  # without --model, when the swarm serves no embedded model (or several, preferred)


@dataclass
class ImproveConfig:
    task: str  # the held-out task the trainer's own figure is measured on (swarm.train.data.TASKS)
    data: str  # a JSONL file, a folder of JSONL files, or datasets:NAME[:SPLIT]
    name: str  # the adapter name versions are published under
    key_path: str  # the publisher's Ed25519 private key
    workdir: str  # the adapter, the run's state and the kept versions
    model: Optional[str] = None  # None: the embedded model the swarm serves (else FALLBACK_MODEL), said at start
    dht_prefix: Optional[str] = None
    initial_peers: list[str] = field(default_factory=list)
    run_id: Optional[str] = None  # train together with every trainer of this run id (hivemind.Optimizer)
    target_batch_size: Optional[int] = None
    rounds: int = 0  # rounds to run; 0: until stopped
    round_steps: int = 20  # optimizer steps per round
    keep: int = 3  # versions kept on disk and listed on the swarm
    held_out: int = 40  # held-out problems of the trainer's own figure (the same ones every round)
    eval_seed: int = 1  # which held-out problems (auditors draw theirs afresh)
    min_new_examples: int = 0  # start a round only once the source holds this many examples more than the last
    poll: float = 2.0  # seconds between looks at a source that has nothing new
    min_gain: float = 0.0  # publish only when the figure beats the published one by more than this
    adapter_kind: str = LORA
    rank: int = 4
    head_rank: int = 8
    lr: float = 0.003
    batch_size: int = 16
    pad_response: int = 8
    seed: int = 0
    request_timeout: float = 30.0
    host_lifetime: float = 3600.0  # seconds the announcement that this trainer serves its versions' files lives
    local_model: bool = False  # run the whole model here (the swarm then serves only the collaboration)
    self_prompt: int = 0  # problems proposed per round by self-prompting (0: off); --data is then the seeds' folder
    stream_coordinator: Optional[str] = None  # follow this coordinator's stream records (base64 key or a file of one)
    also_streams: tuple[str, ...] = ()  # NAME:TASK:DATA of the other streams this trainer can be moved to
    round_per_record: bool = False  # with a coordinator: one round per new record of it (the coordinator paces)

    def validate(self) -> None:
        from swarm.train.config import TASK_NAMES

        if self.task not in TASK_NAMES:
            raise ValueError(f"--task {self.task!r}: one of {', '.join(TASK_NAMES)}")
        if not 1 <= self.keep <= 16:
            raise ValueError("--keep: 1-16 versions")
        if self.round_steps < 1 or self.held_out < 1 or self.rounds < 0:
            raise ValueError("--round-steps and --held-out must be positive, --rounds at least 0")
        if self.self_prompt < 0:
            raise ValueError("--self-prompt must be at least 0")
        if self.also_streams and not self.stream_coordinator:
            raise ValueError("--also-stream: streams to be moved to by a coordinator; give --stream-coordinator")
        if self.round_per_record and not self.stream_coordinator:
            raise ValueError("--round-per-record: rounds paced by a coordinator's records; give --stream-coordinator")
        offers_of(self)  # ValueError for a malformed --also-stream
        if self.self_prompt and not Path(self.data).is_dir():
            raise ValueError(f"--self-prompt writes the accepted answers into --data: {self.data} must be a folder "
                             "(holding the seed examples)")


@dataclass(frozen=True)
class StreamOffer:
    """A stream a trainer can train: its adapter name, task and data source."""

    name: str
    task: str
    data: str

    @classmethod
    def parse(cls, text: str) -> "StreamOffer":
        """``NAME:TASK:DATA`` (DATA may hold ':', as ``datasets:NAME:SPLIT``); ValueError saying what is wrong."""
        from swarm.improve.stream_records import NAME
        from swarm.train.config import TASK_NAMES

        parts = text.split(":", 2)
        if len(parts) != 3 or not NAME.fullmatch(parts[0]) or not parts[2]:
            raise ValueError(f"--also-stream {text[:80]!r}: NAME:TASK:DATA, e.g. hosts:host-blocks:seeds-hb/")
        if parts[1] not in TASK_NAMES:
            raise ValueError(f"--also-stream {text[:80]!r}: the task is one of {', '.join(TASK_NAMES)}")
        return cls(*parts)


def offers_of(config: ImproveConfig) -> list[StreamOffer]:
    """The trainer's own stream, then its ``--also-stream`` ones; ValueError for a malformed one or a name twice."""
    offers = [StreamOffer(config.name, config.task, config.data)] + [StreamOffer.parse(t) for t in config.also_streams]
    if len({offer.name for offer in offers}) != len(offers):
        raise ValueError("--also-stream: each stream name once (the trainer's own --name included)")
    return offers
