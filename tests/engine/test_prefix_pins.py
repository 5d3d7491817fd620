"""The engine's side of a peer fetch and of a decode reservation (``prefix_pins.PrefixPins``): the
fetcher holds the prefix it has and reserves blocks for the rest, the holder pins what it has (pool,
then tiers), the bytes move, the fetcher adopts them into its prefix cache and the request's
admission finds them: its tokens and logits are those of an engine without any cache, bit for bit
(MKL_CBWR=AUTO,STRICT, set in conftest). A fetch that fails frees everything it held. A decode
instance's reservation reads its own host tier back instead of having the prefill side write it."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.block_hash import chain_hashes
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.test_prefix_cache import BS, GREEDY, assert_same, engine, ids, run
from tests.engine.test_prefix_handoff import PARAMS, hand_off

HOST = 64 << 20  # a host tier that keeps everything these tests evict


def evict(eng: LLMEngine, seed: int) -> None:
    """Prompts that fill a 14-block pool, so every earlier cached block leaves it."""
    for i in range(2):
        run(eng, {f"other-{seed}-{i}": ids(seed + i, 6 * BS + 3)})


def fetch(
    fetcher: LLMEngine,
    holder: LLMEngine,
    rid: str,
    prompt: list[int],
    num_blocks: int,
    write: int | None = None,
) -> tuple[int, int]:
    """One fetch as the worker runs it, then the request queued on the fetcher with its holds:
    (blocks asked for, blocks adopted). ``write``: how many of the pinned blocks the "transport"
    delivers (None: all)."""
    key = f"{rid}#fetch"
    hashes, dst = fetcher.reserve_fetch(key, prompt, GREEDY, num_blocks)
    assert len(hashes) == len(dst)
    src = holder.pin_blocks(f"{rid}#serve", hashes)
    n = len(src) if write is None else min(write, len(src))
    if n:
        fetcher.cache.write_blocks(dst[:n], holder.cache.read_blocks(src[:n]))
    holder.release_held(f"{rid}#serve")
    adopted = fetcher.adopt_fetched(key, n)
    fetcher.add_request(rid, prompt_token_ids=prompt, params=GREEDY)
    fetcher.attach_held(key, rid)
    return len(hashes), adopted


def finish(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[Generation, int]:
    gen, cached = Generation(rid, prompt), 0
    while eng.has_unfinished():
        for out in eng.step():
            gen.add(out)
            cached = out.num_cached_tokens
    return gen, cached


def small(model_dir, **kw) -> LLMEngine:
    return engine(model_dir, num_blocks=14, max_num_seqs=2, prefix_caching=True, **kw)


@pytest.mark.parametrize(
    ("own_blocks", "holder_tier"), [(0, False), (2, True)], ids=["from_its_pool", "after_own_from_its_tier"]
)
def test_a_prefix_fetched_from_a_peer_changes_no_bit(
    tiny_model_dir, own_blocks: int, holder_tier: bool
) -> None:
    """The holder computed a 6-block prefix (still in its pool, or evicted to its host tier); the
    fetcher holds the first ``own_blocks`` of it itself and fetches the rest: it computes only what
    follows, and its output is the uncached engine's."""
    shared = ids(40, 6 * BS)
    prompt = shared + ids(41, 19)
    ((cold, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}).values()
    holder = small(tiny_model_dir, kv_host_bytes=HOST)
    run(holder, {"earlier": shared + ids(42, 5)})
    if holder_tier:
        evict(holder, 500)
        assert holder.blocks.lookup(chain_hashes(shared, BS)) == []
    fetcher = small(tiny_model_dir)
    if own_blocks:
        run(fetcher, {"own": shared[: own_blocks * BS] + ids(43, 3)})
    asked, adopted = fetch(fetcher, holder, "r", prompt, num_blocks=6)
    assert asked == adopted == 6 - own_blocks
    gen, cached = finish(fetcher, "r", prompt)
    assert cached == 6 * BS  # every prefix block came from the pool: its own and the fetched ones
    assert_same(cold, gen)
    assert not holder.held and not fetcher.held and not fetcher.reserved and not fetcher.fetching
    if holder_tier:
        assert holder.host_tier is not None and holder.host_tier.stats.hits == 6 - own_blocks
    # both pools are whole: every block free or cached, none held
    assert fetcher.blocks.num_free == fetcher.blocks.capacity == holder.blocks.num_free


def test_a_holder_short_of_room_pins_the_leading_part_that_fits(tiny_model_dir) -> None:
    """The holder's 6-block prefix is in its host tier, and a long prompt it is prefilling holds 10 of
    its pool's 13 blocks: it reads back and pins the leading 2 blocks (3 allocatable, one kept for
    the running sequence) instead of refusing the whole fetch; the fetcher adopts them and computes
    the rest, and its output is the uncached engine's. The holder's load says its next step computes
    a whole step's budget (the rest of that prompt), what a router prices a fetch's wait at."""
    shared = ids(90, 6 * BS)
    prompt = shared + ids(91, 19)
    ((cold, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}).values()
    holder = small(tiny_model_dir, kv_host_bytes=HOST)
    run(holder, {"earlier": shared + ids(92, 5)})
    evict(holder, 700)
    assert holder.blocks.lookup(chain_hashes(shared, BS)) == [] and holder.load().step_tokens == 0
    busy = ids(93, 9 * BS + 3)
    holder.add_request("busy", prompt_token_ids=busy, params=GREEDY)
    holder.step()  # its first 64-token chunk: 83 prompt tokens left, a 66-token step budget
    assert holder.blocks.num_free == 3 and holder.load().step_tokens == 64 + 2
    fetcher = small(tiny_model_dir)
    asked, adopted = fetch(fetcher, holder, "r", prompt, num_blocks=6)
    assert (asked, adopted) == (6, 2)
    gen, cached = finish(fetcher, "r", prompt)
    assert cached == 2 * BS  # the 2 blocks fetched; the other 4 computed
    assert_same(cold, gen)
    assert holder.host_tier is not None and holder.host_tier.stats.hits == 2
    finish(holder, "busy", busy)
    assert not holder.held and not fetcher.held and not fetcher.reserved and not fetcher.fetching
    assert fetcher.blocks.num_free == fetcher.blocks.capacity == holder.blocks.num_free


def test_a_partial_or_failed_fetch_computes_the_rest_and_leaks_nothing(tiny_model_dir) -> None:
    shared = ids(50, 5 * BS)
    prompt = shared + ids(51, 9)
    ((cold, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}).values()
    holder = small(tiny_model_dir)
    run(holder, {"earlier": shared[: 3 * BS] + ids(52, 4)})  # it holds only 3 of the 5 blocks
    fetcher = small(tiny_model_dir)
    asked, adopted = fetch(fetcher, holder, "partial", prompt, num_blocks=5)
    assert (asked, adopted) == (5, 3)
    gen, cached = finish(fetcher, "partial", prompt)
    assert cached == 3 * BS
    assert_same(cold, gen)
    # a fetch that fails: the reservation freed, the request computes everything after its own
    other = small(tiny_model_dir)
    hashes, _ = other.reserve_fetch("f#fetch", prompt, GREEDY, 5)
    assert len(hashes) == 5 and other.blocks.num_free == other.blocks.capacity - 5
    assert other.cancel_fetch("f#fetch") and not other.cancel_fetch("f#fetch")
    other.add_request("f", prompt_token_ids=prompt, params=GREEDY)
    other.attach_held("f#fetch", "f")
    gen, cached = finish(other, "f", prompt)
    assert cached == 0
    assert_same(cold, gen)
    assert other.blocks.num_free == other.blocks.capacity and not other.held and not other.fetching


def test_held_blocks_are_freed_when_the_request_leaves_before_its_admission(tiny_model_dir) -> None:
    holder = small(tiny_model_dir)
    shared = ids(60, 4 * BS)
    run(holder, {"earlier": shared + ids(61, 2)})
    fetcher = small(tiny_model_dir)
    fetch(fetcher, holder, "gone", shared + ids(62, 7), num_blocks=4)
    seq = fetcher.requests["gone"].seq
    assert len(seq.held_blocks) == 4
    assert fetcher.abort("gone")
    assert not seq.held_blocks and fetcher.blocks.num_free == fetcher.blocks.capacity
    assert len(fetcher.blocks.lookup(chain_hashes(shared, BS))) == 4  # still cached for the next one


def test_nothing_to_fetch_for_a_request_scoring_its_prompt_or_without_room(tiny_model_dir) -> None:
    fetcher = small(tiny_model_dir)
    prompt = ids(70, 5 * BS)
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    assert fetcher.reserve_fetch("a", prompt, scoring, 5) == ([], [])
    assert fetcher.reserve_fetch("b", ids(71, 20 * BS), GREEDY, 20) == ([], [])  # 19 blocks never fit
    hashes, dst = fetcher.reserve_fetch("c", prompt, GREEDY, 5)
    assert len(hashes) == len(dst) == 4  # the last token is always computed: 4 usable full blocks
    for key in ("a", "b"):
        assert fetcher.release_held(key)
    assert fetcher.cancel_fetch("c") and fetcher.release_held("c")
    assert fetcher.blocks.num_free == fetcher.blocks.capacity


def test_a_decode_reservation_reads_its_host_tier_back(tiny_model_dir) -> None:
    """D decoded an earlier turn whose blocks its pool evicted to its host tier: its reservation
    reads them back, P writes only the rest, and the output is the uncached engine's."""
    shared = ids(80, 5 * BS)
    earlier, prompt = shared + ids(81, 11), shared + ids(82, 23)
    ((reference, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}, PARAMS).values()
    p = engine(tiny_model_dir, prefix_caching=False)
    d = small(tiny_model_dir, kv_host_bytes=HOST)
    run(d, {"earlier": earlier}, PARAMS)
    evict(d, 600)
    assert d.blocks.lookup(chain_hashes(shared, BS)) == []
    gen, held, written = hand_off(p, d, "r", prompt)
    assert held == 5 and written == (-(-len(prompt) // BS) - 5) * d.cache.block_bytes
    assert d.host_tier is not None and d.host_tier.stats.hits == 5
    assert_same(reference, gen)
