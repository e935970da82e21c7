"""Embeddings below the engine's forward: the default pooling (engine/pooling.py), a Sequence's pooling, the prefix
cache a mean-pooled embedding skips, and BlockManager.flush_unused (FlushCache). No model."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine_helpers import compute
from tokenloop.core.kv_events import BlocksRemoved
from tokenloop.core.request import EmbedParams, ValidRequest
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.pooling import embed_defaults, sentence_transformers_pooling
from tokenloop.engine.sequence import Sequence


def write_st(model_dir, pooling_config: dict | None, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling_config is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (model_dir / "1_Pooling").mkdir()
        (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))


def test_defaults_without_a_sentence_transformers_config_are_last_token_normalized(tmp_path):
    assert sentence_transformers_pooling(tmp_path) == (None, None)
    assert embed_defaults(tmp_path) == EmbedParams("last", True)
    assert embed_defaults(tmp_path, "mean", False) == EmbedParams("mean", False)  # the flags


@pytest.mark.parametrize(("config", "normalize", "expected"), [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, True, EmbedParams("mean", True)),
    ({"pooling_mode_lasttoken": True}, False, EmbedParams("last", False)),
    ({"pooling_mode_cls_token": True}, True, EmbedParams("last", True)),  # not run by the engine: the default
])
def test_the_models_sentence_transformers_config_sets_them(tmp_path, config, normalize, expected):
    write_st(tmp_path, config, normalize)
    assert embed_defaults(tmp_path) == expected
    flags = embed_defaults(tmp_path, "mean" if expected.pooling == "last" else "last", not expected.normalize)
    assert flags.pooling != expected.pooling and flags.normalize != expected.normalize  # the flags win


def test_engine_config_checks_the_pooling_flag():
    with pytest.raises(ValueError, match="embed_pooling must be one of last, mean"):
        EngineConfig(embed_pooling="cls")


def embedding_seq(tokens, pooling: str, normalize: bool) -> Sequence:
    request = ValidRequest("e", tuple(tokens), embed=EmbedParams(pooling, normalize))
    return Sequence.from_request(1, 0, request)


def test_a_sequence_pools_over_chunks_and_forgets_on_recompute():
    states = torch.arange(12, dtype=torch.float32).view(4, 3)
    mean = embedding_seq(range(4), "mean", False)
    mean.pool(states[:3])
    mean.pool(states[3:])
    assert mean.embedding() == pytest.approx(states.mean(0).tolist())
    last = embedding_seq(range(4), "last", True)
    last.pool(states[3:])
    assert last.embedding() == pytest.approx(torch.nn.functional.normalize(states[3], dim=0).tolist())
    mean.reset_for_recompute()
    assert mean.pooled is None


def test_a_mean_pooled_embedding_takes_nothing_from_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = embedding_seq(range(13), "last", True)
    compute(bm, first, 13)
    bm.free(first)
    assert bm.allocate_prefix(embedding_seq(range(13), "last", True)) == 12
    assert bm.allocate_prefix(embedding_seq(range(13), "mean", True)) == 0


def test_flush_unused_drops_only_blocks_no_sequence_uses_and_says_so():
    bm = BlockManager(num_blocks=16, block_size=4)
    done, running = embedding_seq(range(9), "last", True), embedding_seq(range(100, 113), "last", True)
    compute(bm, done, 9)  # two full blocks cached
    compute(bm, running, 13)  # three
    dropped_hashes = {bm.blocks[b].hash for b in done.block_table[:2]}
    bm.free(done)
    bm.take_events()
    assert bm.flush_unused() == 2
    (event,) = bm.take_events()
    assert isinstance(event, BlocksRemoved) and set(event.block_hashes) == dropped_hashes
    assert set(bm.cached) == {bm.blocks[b].hash for b in running.block_table[:3]}  # in use: still cached
    assert bm.num_free_blocks == 16 - 4 and bm.flush_unused() == 0 and bm.take_events() == []
    assert bm.allocate_prefix(embedding_seq(range(9), "last", True)) == 0  # gone from the cache


def test_merge_steps_keeps_the_vector_of_a_final_step():
    from tokenloop.core.executor import Step, merge_steps

    steps = [Step(7, 0, [], num_cached_prompt_tokens=3), Step(7, 0, [], is_final=True, embedding=[0.5, 0.25])]
    (merged,) = merge_steps(steps)
    assert merged.is_final and merged.embedding == [0.5, 0.25] and merged.num_cached_prompt_tokens == 3
