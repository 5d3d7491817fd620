"""Continuous batching bookkeeping, without Paddle: admission, chunking, block accounting, preemption."""

from __future__ import annotations

import pytest

from pdserve.engine.batcher import Batcher, BatcherConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 64, **kw) -> Batcher:
    cfg = BatcherConfig(
        block_size=BS, **{"max_num_seqs": 8, "max_num_batched_tokens": 20, "prefill_chunk_size": 16, **kw}
    )
    return Batcher(cfg, BlockManager(num_blocks))


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100))


def run_step(b: Batcher) -> tuple[list[str], list[tuple[str, int, int]]]:
    """Schedule, then pretend the model ran: advance computed tokens and sample token 7."""
    batch = b.schedule()
    for s in batch.decodes:
        s.num_computed_tokens = s.num_tokens
        s.output_token_ids.append(7)
    for c in batch.prefills:
        c.seq.num_computed_tokens = c.end
        if c.samples:
            c.seq.output_token_ids.append(7)
    return [s.request_id for s in batch.decodes], [(c.seq.request_id, c.start, c.end) for c in batch.prefills]


def test_block_manager_refcounts_and_null_block() -> None:
    bm = BlockManager(5)
    got = bm.allocate(4)
    assert 0 not in got and bm.num_free == 0 and not bm.can_allocate(1)
    bm.share(got[:1])
    bm.free(got)
    assert bm.num_free == 3  # the shared block still has a reference
    bm.free(got[:1])
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(got[:1])
    with pytest.raises(MemoryError):
        bm.allocate(5)


def test_long_prompt_is_chunked_while_decodes_keep_moving() -> None:
    b = make()
    b.add(seq("short", 3))
    assert run_step(b) == ([], [("short", 0, 3)])
    b.add(seq("long", 40))
    steps = [run_step(b) for _ in range(3)]
    assert steps == [
        (["short"], [("long", 0, 16)]),
        (["short"], [("long", 16, 32)]),
        (["short"], [("long", 32, 40)]),
    ]
    assert run_step(b) == (["short", "long"], [])


def test_chunks_align_to_chunk_size_whatever_the_budget() -> None:
    b = make(max_num_batched_tokens=17)
    for i in range(2):
        b.add(seq(f"s{i}", 3))
    run_step(b)
    b.add(seq("long", 20))
    decodes, prefills = run_step(b)
    assert decodes == ["s0", "s1"] and prefills == []  # 15 tokens of budget left: the 16-token chunk waits
    b.running.remove(b.running[0])
    assert run_step(b)[1] == [("long", 0, 16)]


def test_requests_wait_when_blocks_run_out() -> None:
    b = make(num_blocks=6)  # 5 usable blocks of 4 tokens
    b.add(seq("a", 12))  # 3 blocks
    b.add(seq("b", 12))  # would need 3 more
    assert run_step(b)[1] == [("a", 0, 12)]
    assert [s.request_id for s in b.waiting] == ["b"]
    assert b.blocks.num_free == 2
    b.remove(b.running[0])
    assert run_step(b)[1] == [("b", 0, 12)]


def test_max_num_seqs_limits_admission() -> None:
    b = make(max_num_seqs=2)
    for i in range(3):
        b.add(seq(f"s{i}", 2))
    run_step(b)
    assert len(b.running) == 2 and [s.request_id for s in b.waiting] == ["s2"]


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    b = make(num_blocks=5)  # 4 usable blocks
    b.add(seq("old", 4))
    b.add(seq("new", 4))
    run_step(b)  # each holds 1 block, both now have 5 tokens -> need 2 blocks each
    assert b.blocks.num_free == 2
    run_step(b)  # old: +1 block, new: +1 block
    for _ in range(4):
        run_step(b)
    # 9 tokens each now need 3 blocks: only 4 exist, so "new" was preempted to let "old" grow
    assert b.num_preemptions >= 1
    assert [s.request_id for s in b.running] == ["old"]
    victim = b.waiting[0]
    assert victim.request_id == "new" and victim.status is SequenceStatus.WAITING
    assert victim.num_computed_tokens == 0 and victim.block_table == []
    assert len(b.running[0].block_table) * BS >= b.running[0].num_tokens


def bg(rid: str, n: int) -> Sequence:
    """A batch line's sequence (background work)."""
    s = seq(rid, n)
    s.background = True
    return s


def test_an_online_prompt_goes_before_waiting_background_ones() -> None:
    b = make(max_num_batched_tokens=16)  # one 16-token chunk per step
    b.add(bg("batch-1", 16))
    b.add(bg("batch-2", 16))
    b.add(seq("online", 16))
    _, prefills = run_step(b)
    assert prefills == [("online", 0, 16)]
    assert [s.request_id for s in b.waiting] == ["batch-1", "batch-2"]


def test_background_prompts_are_not_prefilled_in_a_step_an_online_prompt_needs() -> None:
    b = make(max_num_batched_tokens=64, prefill_chunk_size=8)
    b.add(bg("batch", 16))
    run_step(b)  # the background prompt's first chunk: nothing online is waiting
    b.add(seq("online", 16))
    _, prefills = run_step(b)  # room for both, yet the background chunk waits
    assert [p[0] for p in prefills] == ["online"]
    _, prefills = run_step(b)  # the online prompt's last chunk: still alone
    assert [p[0] for p in prefills] == ["online"]
    decodes, prefills = run_step(b)  # online decodes now; the background prompt goes on
    assert decodes == ["online"] and prefills == [("batch", 8, 16)]


def test_a_preempted_background_sequence_does_not_block_online_ones() -> None:
    b = make(max_num_batched_tokens=16)
    b.add(bg("batch", 16))
    run_step(b)
    b.add(seq("online", 16))
    b._preempt(b.running[0])  # back at the head of the queue, ahead of the online one
    assert [s.request_id for s in b.waiting] == ["batch", "online"]
    _, prefills = run_step(b)
    assert prefills == [("online", 0, 16)]


def test_preemption_takes_background_sequences_first() -> None:
    b = make(num_blocks=5)  # 4 usable blocks
    b.add(bg("batch", 4))
    run_step(b)
    b.add(seq("online", 4))  # admitted after: the newest, which a plain preemption would take
    for _ in range(6):
        run_step(b)
    # both grew past what 4 blocks hold: the background one gave way although it is older
    assert [s.request_id for s in b.running] == ["online"]
    assert b.waiting[0].request_id == "batch"
