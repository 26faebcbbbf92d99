"""Long prompts are prefilled in chunks and yield to decodes and short prompts (the engine's
scheduler, pure logic and one real engine), and a server's requests reach placement with
their token work (no cluster)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from daskllm.engines import SamplingParams
from daskllm.engines.kv_cache import BlockManager
from daskllm.engines.scheduler import Scheduler, Sequence

BLOCK = 16


def _seq(name: str, prompt_tokens: int) -> Sequence:
    ids = [100 + (i * 7 + sum(map(ord, name))) % 500 for i in range(prompt_tokens)]  # distinct per name
    return Sequence(name, ids, prompt_tokens, SamplingParams(max_tokens=4), Future())


def _scheduler(**limits) -> Scheduler:
    return Scheduler(BlockManager(512, BLOCK), max_num_seqs=8, max_num_batched_tokens=512, **limits)


def _advance(scheduler: Scheduler, step) -> dict[str, int]:
    """Apply a step as an engine would (a finished prompt gets one new token); its sizes by name."""
    for seq, n in step:
        seq.num_computed += n
        scheduler.register_computed_blocks(seq)
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)
    return {seq.request_id: n for seq, n in step}


def test_a_long_prompt_alone_is_prefilled_in_chunks():
    s = _scheduler(prefill_chunk=128, long_prefill=256)
    s.add([_seq("long", 600)])
    sizes = [_advance(s, s.schedule())["long"] for _ in range(5)]
    assert sizes == [128, 128, 128, 128, 88]


def test_a_long_prefill_yields_one_block_a_step_to_decodes_and_short_prompts():
    s = _scheduler(prefill_chunk=128, long_prefill=256)
    s.add([_seq("long", 1000)])
    assert _advance(s, s.schedule()) == {"long": 128}
    s.add([_seq("short", 20)])
    # The short prompt starts at once, whole; the long one advances one block beside it ...
    assert _advance(s, s.schedule()) == {"long": 16, "short": 20}
    # ... and one block a step while the short one decodes, never stopping.
    for _ in range(3):
        assert _advance(s, s.schedule()) == {"long": 16, "short": 1}
    s.finish(next(q for q in s.running if q.request_id == "short"))
    assert _advance(s, s.schedule()) == {"long": 128}  # alone again: whole chunks


def test_a_long_prefill_mid_block_advances_to_the_block_boundary():
    s = _scheduler(prefill_chunk=100, long_prefill=256)
    s.add([_seq("long", 1000)])
    _advance(s, s.schedule())  # 100 tokens: 4 past a block boundary
    s.add([_seq("short", 8)])
    assert _advance(s, s.schedule()) == {"long": 12, "short": 8}


def test_a_long_prompt_yields_to_its_last_token():
    """Its last chunks are its costliest (the deepest into the prompt): they yield too."""
    s = _scheduler(prefill_chunk=128, long_prefill=256)
    s.add([_seq("long", 600)])
    for _ in range(3):
        _advance(s, s.schedule())  # 384 of 600 computed: 216 left, under the threshold
    s.add([_seq("short", 20)])
    assert _advance(s, s.schedule()) == {"long": 16, "short": 20}


def test_prompts_under_the_threshold_share_steps_as_before():
    """A batch of ordinary prompts (each at most the threshold) is not slowed by the rule."""
    s = _scheduler(prefill_chunk=128, long_prefill=256)
    s.add([_seq(f"p{i}", 200) for i in range(3)])
    assert _advance(s, s.schedule()) == {"p0": 128, "p1": 128, "p2": 128}
    assert _advance(s, s.schedule()) == {"p0": 72, "p1": 72, "p2": 72}


def test_chunks_count_cost_deep_into_a_prompt():
    """With a context cost, a token c positions in weighs 1 + c / cost: chunks shrink with
    depth, alone and yielding, so a step deep in a long prompt is no longer than a first one."""
    s = _scheduler(prefill_chunk=128, long_prefill=256, context_cost=256)
    s.add([_seq("long", 1000)])
    sizes = [_advance(s, s.schedule())["long"] for _ in range(3)]
    assert sizes == [128, 85, 69]  # 128 / (1 + 0), / (1 + 128/256), / (1 + 213/256)
    s.add([_seq("short", 8)])
    assert _advance(s, s.schedule()) == {"long": 6, "short": 8}  # 16 / (1 + 282/256) = 7.6: to the block's end
    assert _advance(s, s.schedule()) == {"long": 7, "short": 1}  # 16 / (1 + 288/256) = 7.5


def test_a_tail_of_a_block_or_less_goes_with_the_chunk_before_it():
    """256 then 240 by cost would leave 16 tokens for a step of their own (a whole pass over the
    weights): they join the second chunk."""
    s = _scheduler(prefill_chunk=256, long_prefill=1024, context_cost=3892)
    s.add([_seq("p", 512)])
    assert [_advance(s, s.schedule())["p"] for _ in range(2)] == [256, 256]


def test_without_the_rule_a_running_prompt_takes_the_whole_budget():
    s = _scheduler()
    s.add([_seq("long", 2000)])
    _advance(s, s.schedule())
    s.add([_seq("short", 20)])
    assert _advance(s, s.schedule()) == {"long": 512}  # the short one waits for the long prefill


@pytest.mark.bits
def test_a_short_request_finishes_first_and_every_output_is_the_one_alone(tiny_model_dir):
    """On a real engine: sent together behind a long prompt, a short request is done long
    before it, with the same tokens as each request alone (chunks change no output)."""
    import numpy as np

    from daskllm.engines.torch_engine import TorchEngine

    rng = np.random.default_rng(3)
    long, short = rng.integers(100, 250, 600).tolist(), rng.integers(100, 250, 12).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(**limits) -> tuple[list[str], list[list[int]]]:
        with TorchEngine("tiny", device="cpu", max_num_batched_tokens=64, **limits) as engine:
            finished: list[str] = []
            futures = engine.submit_many([long, short], params)
            for name, f in zip(("long", "short"), futures):
                f.add_done_callback(lambda _, name=name: finished.append(name))
            tokens = [f.result(timeout=120).token_ids for f in futures]
            alone = []
            for prompt in (long, short):
                engine.reset_prefix_cache()
                alone.append(engine.generate([prompt], params)[0].token_ids)
        assert tokens == alone
        return finished, tokens

    fair, fair_tokens = run(prefill_chunk_tokens=64, long_prefill_tokens=64)
    unfair, unfair_tokens = run(prefill_chunk_tokens=0, long_prefill_tokens=0)
    assert fair == ["short", "long"]
    assert unfair == ["long", "short"]  # without the rule the short one waits behind the prefill
    assert fair_tokens == unfair_tokens


@pytest.mark.parametrize("value, expected", [("auto", 256), (None, 256), (0, None), (96, 96)])
def test_the_limits_read_auto_off_and_numbers(value, expected):
    from daskllm.engines.torch_engine import _auto

    assert _auto(value, "prefill-chunk-tokens", 256) == expected


def test_parts_planned_for_a_worker_carry_their_token_work(tiny_model_dir):
    """The server charges each worker the tokens it sent there: a long prompt weighs more."""
    import daskllm
    from daskllm.runtime.here import plan_here

    long = daskllm.generate("word " * 400, model="tiny", max_tokens=8)
    short = daskllm.generate("hi", model="tiny", max_tokens=8)
    parts, _ = plan_here([long, short])
    work = {tuple(p.keys): p.tokens for p in parts}
    assert len(parts) == 2
    heavy, light = sorted(work.values(), reverse=True)
    assert heavy > 400 > light > 8
    # ... and the placement plugin, which places it and counts it in its worker's queue, sees it
    annotation = parts[0].annotation()
    assert (annotation["engine"], annotation["model"], annotation["prompt_tokens"]) == ("llm", "tiny", parts[0].tokens)
