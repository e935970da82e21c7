"""Which sequences run in the next step, and how many of their tokens. Plain Python, no tensors.

Each step has a token budget (`max_num_tokens`) and a sequence cap (`max_batch_size`):
1. running decodes first (one token each), so a long prompt never stalls them;
2. then running sequences still in prefill, one chunk each from what budget is left;
3. then waiting sequences, oldest first, while budget, batch slots and KV blocks last.
When a running sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are freed and it goes back to the front of `waiting`, to be recomputed later (prompt
and output so far), so no request is ever lost.
A paused sequence (`pause`: its reader stopped reading) leaves both queues and gives back its blocks the same
way; `resume` puts it at the back of `waiting`, to be recomputed like a preempted one.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """`waiting` and `running` queues over a BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_tokens: int, max_batch_size: int):
        self.block_manager = block_manager
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: set[Sequence] = set()  # neither waiting nor running, holding no blocks (pause / resume)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick (sequence, number of new tokens) pairs for one step; allocates their blocks."""
        budget = self.max_num_tokens
        scheduled: list[tuple[Sequence, int]] = []
        # 1-2) running: decodes, then prefill chunks
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget
            if seq.draft:  # a speculative verification: only what budget and free blocks allow, no preemption
                seq.draft = seq.draft[:budget - 1]
                if seq.draft and not self.block_manager.append_slots(seq, 1 + len(seq.draft)):
                    seq.draft = []
            num_new = min(seq.num_uncomputed_tokens + len(seq.draft), budget)
            if not self._make_room(seq, num_new, scheduled):
                continue  # seq itself was preempted
            scheduled.append((seq, num_new))
            budget -= num_new
        # 3) waiting, oldest first
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.append_slots(seq, num_new):
                self.block_manager.free(seq)  # a waiting sequence holds no blocks, prefix hits included
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.block_manager.record_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled

    def _make_room(self, seq: Sequence, num_new: int, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Allocate blocks for `seq`, preempting the newest running sequences until it fits."""
        while not self.block_manager.append_slots(seq, num_new):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
            for i, (s, _) in enumerate(scheduled):
                if s is victim:
                    del scheduled[i]
                    break
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it at the front of `waiting` for recompute."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def pause(self, seq: Sequence) -> None:
        """Take an unfinished `seq` out of the queues and free its blocks; it keeps its tokens, RNG and matcher."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return  # finished, or already paused
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.paused.add(seq)

    def resume(self, seq: Sequence) -> None:
        """A paused `seq` waits again (at the back), to recompute its prompt and output so far."""
        if seq in self.paused:
            self.paused.discard(seq)
            self.waiting.append(seq)

    def advance(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After the forward pass: the scheduled tokens now have K/V in the cache."""
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new - len(seq.draft)  # drafted positions count once accepted (spec_step)
            self.block_manager.commit_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.paused.discard(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.matcher = None  # a structured sequence's grammar matcher goes with it
