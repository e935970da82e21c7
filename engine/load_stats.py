"""The engine's load as ExecutorStats (stats(), GetLoad, /metrics), updated after every step and command."""

from __future__ import annotations

from collections.abc import Sequence

from tokenloop.core.executor import ExecutorStats

from .block_manager import BlockManager
from .scheduler import Scheduler
from .speculation import SpecStats


def update_stats(st: ExecutorStats, sched: Scheduler, blocks: BlockManager, latencies: Sequence[float],
                 spec: SpecStats) -> None:
    """Write the scheduler's, the KV cache's and speculation's figures into `st` (under the engine's lock); one
    more step; the step latency is the mean of `latencies` (the last steps')."""
    running = {s.executor_id for s in sched.running}
    st.num_running = len(running)
    st.num_waiting = len({s.executor_id for s in sched.waiting} - running) if sched.waiting else 0
    st.kv_blocks_used = blocks.num_used_blocks
    st.num_preemptions = sched.num_preemptions
    st.num_steps += 1
    st.step_latency_s = sum(latencies) / len(latencies) if latencies else 0.0
    st.kv_blocks_cached = blocks.num_cached_blocks
    st.prefix_cache_hit_rate = blocks.hit_rate
    st.num_prefix_cache_evictions = blocks.num_evictions
    st.num_prefix_cache_hit_tokens = blocks.num_hit_tokens
    st.num_prefix_cache_query_tokens = blocks.num_query_tokens
    st.spec_num_drafts, st.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
    st.spec_num_accepted_tokens, st.spec_accepted_per_pos = spec.num_accepted_tokens, tuple(spec.accepted_per_pos)
