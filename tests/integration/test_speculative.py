"""Speculative decoding in the engine step (engine/spec_step.py): with `speculative="ngram"` every request gives the
tokens it gives without it, alone and in any batch, greedy or seeded, with every feature that touches a step:
log probabilities, stop tokens and min/max new tokens, structured output, LoRA, prefix caching, n > 1,
preemption, cancellation. Two tiny random checkpoints: one whose greedy output falls into repetition (drafts are
accepted, several tokens a step) and one whose output does not (drafts are mostly rejected)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from tests.engine_helpers import greedy_request, run_all, sampled_request, tokens, with_output
from tests.lora_helpers import write_adapter
from tests.structured_helpers import check_regex, compiler_for, constrained
from tests.tiny_model import make_tiny_model
from tokenloop.core.request import FinishReason, StoppingParams
from tokenloop.engine.block_manager import block_hash
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.speculation import SpeculativeConfig


@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """Small weights: greedy output settles into repeating one token (every draft accepted)."""
    return make_tiny_model(tmp_path_factory.mktemp("repetitive"), "llama", std=0.1)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Large weights over a small vocabulary: some repeats, many rejected drafts."""
    return make_tiny_model(tmp_path_factory.mktemp("mixed"), "llama", std=1.0, vocab_size=64)


def tokenizer_text(checkpoint, ids: list[int]) -> str:
    from tokenloop.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(checkpoint).decode(ids)


def engine(checkpoint, mode: str, **config) -> Engine:
    config = {"dtype": "float32", "kv_cache_tokens": 8192, "block_size": 16, "speculative": mode, **config}
    return Engine.from_dir(checkpoint, EngineConfig(**config))


def prompts(vocab: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    """Random prompts, each ending with a span that occurred earlier in it (so the first decode may draft)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        base = [rng.randrange(3, vocab) for _ in range(rng.randrange(12, 30))]
        out.append(base + [rng.randrange(3, vocab) for _ in range(4)] + base[:rng.randrange(3, 8)])
    return out


def outputs(checkpoint, mode: str, requests, *, together: bool = True, **config):
    """Each request's sequences' steps ({seq index: steps} per request, in order), and the engine's stats."""
    eng = engine(checkpoint, mode, **config)
    try:
        if together:
            ids, steps = run_all(eng, requests)
        else:
            ids, steps = [], {}
            for request in requests:
                one, got = run_all(eng, [request])
                ids += one
                steps |= got
        return [{i: steps[(rid, i)] for i in range(r.n)} for rid, r in zip(ids, requests)], eng.stats()
    finally:
        eng.shutdown()


def token_lists(result) -> list[list[list[int]]]:
    return [[tokens(seqs[i]) for i in sorted(seqs)] for seqs in result]


@pytest.mark.parametrize("model", ["repetitive", "mixed"])
def test_greedy_output_is_identical_alone_and_batched(model, request):
    checkpoint = request.getfixturevalue(model)
    vocab = 384 if model == "repetitive" else 64
    reqs = [greedy_request(p, 48) for p in prompts(vocab)]
    off, _ = outputs(checkpoint, "off", reqs)
    alone, _ = outputs(checkpoint, "ngram", reqs, together=False)
    batched, stats = outputs(checkpoint, "ngram", reqs, speculative_max_batch_size=8)
    assert token_lists(alone) == token_lists(off)
    assert token_lists(batched) == token_lists(off)
    assert stats.spec_num_drafts > 0 and 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if model == "repetitive":
        assert stats.spec_tokens_per_step > 2.5  # several tokens per verification
        assert stats.spec_acceptance_rate > 0.9


def test_seeded_sampling_is_identical_with_every_filter_and_n(mixed):
    filters = [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}, {"repetition_penalty": 1.3, "presence_penalty": 0.2,
                                                                 "frequency_penalty": 0.1}]
    reqs = [sampled_request(p, seed=7 + i, max_new_tokens=40, n=2, temperature=0.7, **f)
            for i, (p, f) in enumerate(zip(prompts(64, 5, seed=3), filters))]
    off, _ = outputs(mixed, "off", reqs)
    on, stats = outputs(mixed, "ngram", reqs, speculative_max_batch_size=16)
    assert token_lists(on) == token_lists(off)
    assert stats.spec_num_drafts > 0


def test_log_probabilities_are_the_models(repetitive):
    reqs = [with_output(greedy_request(p, 32), logprobs=True, top_logprobs=3) for p in prompts(384, 3)]
    off, _ = outputs(repetitive, "off", reqs)
    on, stats = outputs(repetitive, "ngram", reqs)
    assert stats.spec_num_accepted_tokens > 0
    for seqs_off, seqs_on in zip(off, on):
        lp_off = [lp for s in seqs_off[0] for lp in s.logprobs or []]
        lp_on = [lp for s in seqs_on[0] for lp in s.logprobs or []]
        assert len(lp_on) == len(lp_off) == 32
        assert lp_on == pytest.approx(lp_off, abs=1e-5)
        tops_on = [t for s in seqs_on[0] for t in s.top_logprobs or []]
        tops_off = [t for s in seqs_off[0] for t in s.top_logprobs or []]
        assert [[i for i, _ in t] for t in tops_on] == [[i for i, _ in t] for t in tops_off]


def test_stop_token_min_and_max_new_tokens_end_where_they_would(repetitive):
    base = prompts(384, 1)[0]
    plain = token_lists(outputs(repetitive, "off", [greedy_request(base, 40)])[0])[0][0]
    repeated = plain[-1]  # the token the output settles on: drafts of it are accepted in runs
    first = plain.index(repeated)
    reqs = [greedy_request(base, 40, stop_token_ids=(repeated,), ignore_eos=True),
            greedy_request(base, 40, stop_token_ids=(repeated,), min_new_tokens=first + 9, ignore_eos=True),
            greedy_request(base, 23), greedy_request(base, 1), greedy_request(base, 2)]
    off, _ = outputs(repetitive, "off", reqs)
    on, _ = outputs(repetitive, "ngram", reqs)
    assert token_lists(on) == token_lists(off)
    ends = [seqs[0][-1] for seqs in on]
    assert [e.finish_reason for e in ends] == [seqs[0][-1].finish_reason for seqs in off]
    assert ends[0].finish_reason is FinishReason.STOP_TOKEN and ends[0].matched_stop_token == repeated
    lengths = [len(t[0]) for t in token_lists(on)]
    assert lengths[0] == first + 1 and lengths[1] >= first + 9 and lengths[2:] == [23, 1, 2]


def test_structured_output_is_identical(repetitive):
    compiler = compiler_for(repetitive)
    reqs = [constrained(compiler, "regex", r"[0-9]{3,30}", p, seed=s, max_new_tokens=40)
            for s, p in enumerate(prompts(384, 3))]
    reqs.append(constrained(compiler, "regex", r"(ab|cd)+x", prompts(384, 1)[0], seed=5, temperature=0.0,
                            max_new_tokens=40))
    off, _ = outputs(repetitive, "off", reqs)
    on, _ = outputs(repetitive, "ngram", reqs)
    assert token_lists(on) == token_lists(off)
    for seqs in on[:3]:
        check_regex(tokenizer_text(repetitive, tokens(seqs[0])), r"[0-9]{3,30}")


def test_lora_output_is_identical(repetitive, tmp_path):
    adapter = write_adapter(repetitive, tmp_path / "adapter", scale=0.05)
    results = []
    for mode in ("off", "ngram"):
        eng = engine(repetitive, mode)
        try:
            eng.add_lora(eng.read_lora("a", adapter))
            reqs = [replace(greedy_request(p, 32), lora="a") for p in prompts(384, 3)] + \
                [greedy_request(p, 32) for p in prompts(384, 2, seed=9)]
            ids, steps = run_all(eng, reqs)
            results.append([tokens(steps[(i, 0)]) for i in ids])
        finally:
            eng.shutdown()
    assert results[0] == results[1]


def test_prefix_cache_holds_only_accepted_tokens(repetitive):
    """Every block the cache stores holds the tokens the sequence really has at those positions, so a request that
    continues a speculative one from the cache gives what an engine without any cache gives."""
    base = prompts(384, 1)[0]
    eng = engine(repetitive, "ngram", block_size=4)
    try:
        ids, steps = run_all(eng, [greedy_request(base, 40)])
        text = base + tokens(steps[(ids[0], 0)])
        assert eng.stats().spec_num_accepted_tokens > 0
        expected, prev = set(), None  # the chained hashes of the text's full blocks
        for i in range(len(text) // 4):
            prev = block_hash(prev, tuple(text[i * 4:(i + 1) * 4]))
            expected.add(prev)
        cached = set(eng.block_manager.cached)
        assert cached <= expected and len(cached) >= (len(text) - 2) // 4
        cont, got = run_all(eng, [greedy_request(text[:-1], 12)])
        hit = got[(cont[0], 0)]
    finally:
        eng.shutdown()
    assert hit[0].num_cached_prompt_tokens > len(base)
    cold, _ = outputs(repetitive, "off", [greedy_request(text[:-1], 12)], enable_prefix_caching=False)
    assert tokens(hit) == token_lists(cold)[0][0]


def test_preemption_mid_run_changes_nothing(mixed):
    reqs = [greedy_request(p, 40) for p in prompts(64, 8, seed=4)]
    off, _ = outputs(mixed, "off", reqs)
    on, stats = outputs(mixed, "ngram", reqs, kv_cache_tokens=384, speculative_max_batch_size=8)
    assert stats.num_preemptions > 0
    assert token_lists(on) == token_lists(off)


def test_cancel_while_drafting_frees_everything(repetitive):
    eng = engine(repetitive, "ngram")
    try:
        rid = eng.enqueue(greedy_request(prompts(384, 1)[0], 400))
        seen = []
        while sum(len(s.token_ids) for s in seen) < 30:
            seen += eng.await_responses(1.0)
        eng.cancel(rid)
        while not any(s.is_final for s in seen):
            seen += eng.await_responses(1.0)
        assert seen[-1].finish_reason is FinishReason.CANCELLED
        ids, steps = run_all(eng, [greedy_request(prompts(384, 1, seed=2)[0], 16)])  # the engine goes on
        assert len(tokens(steps[(ids[0], 0)])) == 16
        assert eng.stats().kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_usage_totals_and_stats(repetitive):
    reqs = [greedy_request(p, 40) for p in prompts(384, 2)]
    on, stats = outputs(repetitive, "ngram", reqs)
    drafted = accepted = 0
    for seqs in on:
        last = [s for s in seqs[0] if s.num_draft_tokens is not None][-1]
        assert 0 < last.num_accepted_draft_tokens <= last.num_draft_tokens
        drafted, accepted = drafted + last.num_draft_tokens, accepted + last.num_accepted_draft_tokens
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (drafted, accepted)
    per_pos = stats.spec_accepted_per_pos
    assert sum(per_pos) == accepted and list(per_pos) == sorted(per_pos, reverse=True)  # a later position only
    assert per_pos[0] <= stats.spec_num_drafts  # when the ones before it were accepted


def test_a_large_batch_drafts_nothing(repetitive):
    reqs = [greedy_request(p, 24) for p in prompts(384, 3)]
    _, stats = outputs(repetitive, "ngram", [replace(r, stopping=StoppingParams(max_new_tokens=24, ignore_eos=True))
                                             for r in reqs], speculative_max_batch_size=2)
    assert stats.spec_num_drafts == 0  # three sequences decode together from start to end


def chi_square_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at the normal quantile z (p = 1e-4), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_models_distribution(repetitive):
    """Three sampled tokens (top-k 2, temperature 1) over 900 seeded sequences with speculation on, against the
    exact distribution from the model's own log probabilities: the third token is sampled at a verification's row 1
    whenever the second token accepted the draft."""
    prompt = prompts(384, 1)[0]
    eng = engine(repetitive, "ngram", max_batch_size=64, max_num_tokens=512)
    eng.speculative = SpeculativeConfig(mode="ngram", prompt_lookup_min=1, max_batch_size=64)
    try:
        def top2(ids):
            rid, steps = run_all(eng, [with_output(greedy_request(ids, 1), logprobs=True, top_logprobs=2)])
            pairs = dict(steps[(rid[0], 0)][0].top_logprobs[0])
            norm = math.log(sum(math.exp(v) for v in pairs.values()))
            return {t: math.exp(v - norm) for t, v in pairs.items()}

        exact = {(): 1.0}
        for _ in range(3):
            exact = {seq + (t,): p * q for seq, p in exact.items() for t, q in top2(prompt + list(seq)).items()}
        before = eng.stats()
        reqs = [sampled_request(prompt, seed=s, max_new_tokens=3, n=30, top_k=2) for s in range(30)]
        ids, steps = run_all(eng, reqs)
        after = eng.stats()
    finally:
        eng.shutdown()
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 100  # rows 1 sampled often
    counts: dict[tuple[int, ...], int] = {}
    for rid in ids:
        for i in range(30):
            key = tuple(tokens(steps[(rid, i)]))
            counts[key] = counts.get(key, 0) + 1
    total = sum(counts.values())
    assert set(counts) <= set(exact)
    stat = sum((counts.get(k, 0) - total * p) ** 2 / (total * p) for k, p in exact.items())
    assert stat < chi_square_limit(len(exact) - 1), (stat, counts, exact)


def test_through_the_apis_usage_and_load_report_it(repetitive):
    """tokenloop.v1 reports each sequence's drafted and accepted tokens and GetLoad the rates; the router APIs
    (trtllm.TrtllmService, vllm.grpc.engine.VllmEngine) give the same tokens with speculation on as off."""
    from tests.conftest import run
    from tests.integration.service_harness import gen, read_all, serving, trtllm
    from tokenloop.v1 import tokenloop_pb2 as pb

    ids = prompts(384, 1)[0]

    async def v1(executor):
        async with serving(repetitive, executor) as (_, stub, _ex):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0),
                                         stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True))
            done = (await read_all(stub.Generate(request)))[-1].complete
            return done, await stub.GetLoad(pb.GetLoadRequest())

    async def router(executor):
        """The trtllm.TrtllmService's streamed tokens and the vllm.grpc.engine.VllmEngine's unary output."""
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

        async with trtllm(repetitive, executor) as (server, stub, _ex):
            msgs = await read_all(stub.Generate(gen(ids, max_tokens=24, request_id="r")))
            streamed = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), stream=False,
                                              sampling_params=vpb.SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True))
                msgs = await read_all(vpb_grpc.VllmEngineStub(channel).Generate(request))
            return streamed, [list(m.complete.output_ids) for m in msgs if m.HasField("complete")]

    done, load = run(v1(engine(repetitive, "ngram")))
    off, _ = run(v1(engine(repetitive, "off")))
    assert list(done.token_ids) == list(off.token_ids) and len(done.token_ids) == 40
    assert 0 < done.usage.accepted_draft_tokens <= done.usage.draft_tokens
    assert (off.usage.draft_tokens, off.usage.accepted_draft_tokens) == (0, 0)
    assert 0 < load.spec_acceptance_rate <= 1 and load.spec_tokens_per_step > 1
    on_router, off_router = run(router(engine(repetitive, "ngram"))), run(router(engine(repetitive, "off")))
    assert on_router == off_router and len(on_router[0]) == 24 and on_router[1] == [on_router[0]]
