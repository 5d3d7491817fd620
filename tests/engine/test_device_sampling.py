"""The torch platform's sampler (engine/cuda/torch_sampler.py) against the numpy sampler (sampler.py), on
torch's CPU device: the same tokens for every setting, the same logprobs, seeded requests that
reproduce, and only ids crossing to the host.

Made deterministic, not lucky: the hand-made logits are multiples of 2**-7 (distinct where top-k or
top-n cut them, heavily tied where ties by id are the point), and the bias and penalties here keep
them on that grid (the repetition penalty is 2), so every ordering is decided by a margin far above
float rounding. What rounding can still move (numpy's float32 sequential and pairwise sums against
the device's, a float32 against a float64 cumulative sum) is where a uniform, ``top_p`` or ``min_p``
meets a cumulative boundary; every sampled row is first checked to give numpy's token still when the
uniform, ``top_p`` and ``min_p`` each move by a relative 1e-5, a hundred times more than those sums
can differ, so a match is never an accident of the last bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch platform needs PyTorch (pip install 'pdserve[cuda]')")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.cuda.torch_executor import TorchPlatform  # noqa: E402
from pdserve.engine.cuda.torch_sampler import DeviceSampler, best_first  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_runner import PromptRows  # noqa: E402
from pdserve.engine.sample_plan import SamplingPlanner  # noqa: E402
from pdserve.engine.sampler import Sample, Sampler, logprobs_of, make_rng  # noqa: E402
from pdserve.engine.sequence import Sequence  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

VOCAB, WIDTH = 640, 656  # the sampler's vocab_limit, and logits rows with 16 padding ids beyond it
EOS, STOP = 7, 9
STEP = 2.0**-7
SHIFT = 1e-5  # relative moves of the uniform, top_p and min_p a row's token must survive


class FixedGrammar:
    def __init__(self, allowed: list[int]) -> None:
        self.mask = np.zeros(VOCAB, dtype=bool)
        self.mask[allowed] = True

    def allowed(self) -> np.ndarray:
        return self.mask


class FixedUniform:
    """A generator whose one draw is given (the stability check moves it)."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@dataclasses.dataclass
class Case:
    """One sampling row: its settings, history and grammar; ``seq(seed)`` makes a fresh sequence."""

    name: str
    params: SamplingParams
    prompt: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3])
    output: list[int] = dataclasses.field(default_factory=list)
    allowed: list[int] | None = None
    distinct: bool = True  # its logits row has no ties (top-k, top-n and argmax cuts)

    def seq(self, seed: int, params: SamplingParams | None = None) -> Sequence:
        s = Sequence(self.name, list(self.prompt), params or self.params, output_token_ids=list(self.output))
        s.grammar = FixedGrammar(self.allowed) if self.allowed is not None else None  # type: ignore[assignment]
        s.rng = make_rng(seed)
        return s


def cases(row_best: Callable[[int], list[int]]) -> list[Case]:
    """Every setting of the numpy sampler, greedy and drawn. ``row_best(i)``: row i's best ids."""
    t = dict(max_tokens=64, ignore_eos=False)
    b = row_best
    return [
        Case("plain", SamplingParams(temperature=0, **t)),
        Case("greedy-logprobs", SamplingParams(temperature=0, logprobs=5, **t)),
        Case(
            "greedy-bias",
            SamplingParams(temperature=0, logit_bias={b(2)[3]: 3.5, b(2)[0]: -100, 650: 100}, **t),
        ),
        Case("greedy-grammar", SamplingParams(temperature=0, **t), allowed=[b(3)[4], b(3)[9], 400, EOS]),
        Case("greedy-min-tokens", SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[STOP], **t)),
        Case(
            "greedy-repetition", SamplingParams(temperature=0, repetition_penalty=2.0, **t), prompt=b(5)[:3]
        ),
        Case(
            "greedy-presence-frequency",
            SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, **t),
            output=[b(6)[0], b(6)[0], b(6)[1], 2],
        ),
        Case("temperature", SamplingParams(temperature=0.7, **t)),
        Case("top-k", SamplingParams(temperature=1.3, top_k=20, **t)),
        Case("top-p", SamplingParams(temperature=1.0, top_p=0.8, **t)),
        Case("min-p", SamplingParams(temperature=0.9, min_p=0.1, **t)),
        Case(
            "top-k-p-min-p-logprobs",
            SamplingParams(temperature=1.1, top_k=50, top_p=0.9, min_p=0.02, logprobs=3, **t),
        ),
        Case(
            "everything",
            SamplingParams(
                temperature=0.8,
                top_p=0.95,
                min_tokens=2,
                stop_token_ids=[STOP],
                repetition_penalty=2.0,
                presence_penalty=0.25,
                frequency_penalty=0.5,
                logit_bias={b(12)[2]: 1.5, 3: -2.0},
                logprobs=2,
                **t,
            ),
            prompt=[b(12)[0], 5],
            output=[b(12)[1], b(12)[1], 11],
            allowed=[*b(12)[:30], EOS, STOP],
        ),
        Case("grammar-leaves-only-eos", SamplingParams(temperature=1.0, min_tokens=5, **t), allowed=[EOS]),
        Case("grammar-allows-nothing", SamplingParams(temperature=0.5, **t), allowed=[]),
        Case("ties-by-id", SamplingParams(temperature=1.0, logprobs=2, **t), distinct=False),
        Case("greedy-ties", SamplingParams(temperature=0, logprobs=2, **t), distinct=False),
        Case(  # below zero the penalty multiplies: the worst ids allowed, the best of them repeated
            "greedy-repetition-negative",
            SamplingParams(temperature=0, repetition_penalty=2.0, **t),
            prompt=[b(17)[-5]],
            allowed=b(17)[-5:],
        ),
    ]


def make_logits(rng: np.random.Generator, n: int, tied: set[int]) -> np.ndarray:
    """Rows of multiples of 2**-7: distinct values in [-12, 12), or (rows ``tied``) three distinct
    best values over a bulk of ties (multiples of 0.5 in [-6, 0)); padding ids far above all."""
    rows = np.empty((n, WIDTH), np.float32)
    for i in range(n):
        if i in tied:
            row = rng.integers(-12, 0, VOCAB) * 0.5
            row[rng.choice(VOCAB, 3, replace=False)] = [2.0, 1.5, 1.0]
        else:
            row = (rng.permutation(3072)[:VOCAB] - 1536) * STEP
        rows[i, :VOCAB] = row
    rows[:, VOCAB:] = 100.0  # never sampled: beyond the tokenizer
    return rows


def numpy_token(row: np.ndarray, case: Case, seed: int, u: float | None, **moved: float) -> int:
    params = dataclasses.replace(case.params, **moved) if moved else case.params
    seq = case.seq(seed, params)
    if u is not None:
        seq.rng = FixedUniform(u)  # type: ignore[assignment]
    return Sampler(VOCAB, [EOS])(row[None], [seq])[0].token_id


def assert_stable(row: np.ndarray, case: Case, seed: int) -> None:
    """numpy's token for this row stays when the uniform, top_p and min_p move by SHIFT."""
    if case.params.is_greedy:
        return
    u = make_rng(seed).random()
    p = case.params
    want = numpy_token(row, case, seed, u)
    moves: list[dict] = [{}]
    if p.top_p < 1.0:
        moves += [{"top_p": p.top_p * (1 - SHIFT)}, {"top_p": min(1.0, p.top_p * (1 + SHIFT))}]
    if p.min_p > 0.0:
        moves += [{"min_p": p.min_p * (1 - SHIFT)}, {"min_p": p.min_p * (1 + SHIFT)}]
    for move in moves:
        for v in (u * (1 - SHIFT), u * (1 + SHIFT)):
            got = numpy_token(row, case, seed, min(v, np.nextafter(1.0, 0.0)), **move)
            assert got == want, f"{case.name} seed {seed}: a rounding-sized move changes the token ({move})"


def assert_same_sample(got: Sample, want: Sample, what: str) -> None:
    assert got.token_id == want.token_id, what
    if want.logprob is None:
        assert got.logprob is None, what
        return
    assert got.logprob == pytest.approx(want.logprob, abs=1e-9), what
    assert got.rank == want.rank, what
    if want.top_logprobs is None:
        assert got.top_logprobs is None, what
        return
    assert got.top_logprobs is not None, what
    assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs], what
    np.testing.assert_allclose([v for _, v in got.top_logprobs], [v for _, v in want.top_logprobs], atol=1e-9)


@pytest.mark.parametrize("round_", range(12))
def test_the_device_sampler_picks_the_numpy_sampler_s_tokens_for_every_setting(round_: int) -> None:
    """A batch holding every setting (greedy and drawn, top-k beside full-vocabulary rows), twelve
    rounds of logits and seeds: each row's token, logprob, rank and alternatives are numpy's."""
    rng = np.random.default_rng(100 + round_)
    probe = cases(lambda i: list(range(10, 60)))
    tied = {i for i, c in enumerate(probe) if not c.distinct}
    logits = make_logits(rng, len(probe), tied)
    order = np.argsort(-logits[:, :VOCAB], axis=1, kind="stable")
    batch = cases(lambda i: [int(t) for t in order[i]])
    logits[4, EOS] = logits[4, :VOCAB].max() + 1.0  # min_tokens must ban EOS to change the pick
    seeds = [1000 * round_ + i for i in range(len(batch))]
    sampler = Sampler(VOCAB, [EOS])
    want = sampler(logits, [c.seq(s) for c, s in zip(batch, seeds)])
    for i, (c, s) in enumerate(zip(batch, seeds)):
        assert_stable(logits[i], c, s)
    seqs = [c.seq(s) for c, s in zip(batch, seeds)]
    plan = SamplingPlanner(sampler).plan(seqs, [])
    assert not plan.plain and plan.grammar_bits.shape == (4, VOCAB // 8)  # allows-nothing sends none
    got = DeviceSampler(torch.device("cpu")).pick(torch.from_numpy(logits), plan).samples(plan)
    for i, c in enumerate(batch):
        assert_same_sample(got[i], want[i], f"{c.name} (round {round_})")
    assert got[4].token_id != EOS and got[13].token_id == EOS
    assert got[17].token_id == batch[17].allowed[1]  # type: ignore[index]
    for c, s, seq in zip(batch, seeds, seqs):  # one draw per drawn row, none for greedy ones
        rng_after = make_rng(s)
        if not c.params.is_greedy:
            rng_after.random()
        assert seq.rng is not None and seq.rng.random() == rng_after.random(), c.name


def test_plain_greedy_rows_take_the_argmax_below_the_vocabulary() -> None:
    logits = make_logits(np.random.default_rng(5), 3, set())
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0)) for i in range(3)]
    plan = SamplingPlanner(Sampler(VOCAB, [EOS])).plan(seqs, [])
    assert plan.plain
    picked = DeviceSampler(torch.device("cpu")).pick(torch.from_numpy(logits), plan)
    assert picked.tokens.tolist() == logits[:, :VOCAB].argmax(axis=1).tolist()
    assert picked.logits is None


def test_prompt_logprobs_are_logprobs_of_on_the_device() -> None:
    """Prompt positions scored after the sampling rows: each token's logprob, rank and alternatives."""
    rng = np.random.default_rng(8)
    logits = make_logits(rng, 9, set())
    prompt = [int(t) for t in rng.integers(3, VOCAB, 8)]
    seq = Sequence("p", prompt, SamplingParams(temperature=0, prompt_logprobs=4))
    seq.rng = make_rng(None)
    other = Sequence("q", [1, 2], SamplingParams(temperature=0.5, seed=3))
    other.rng = make_rng(3)
    span = PromptRows(seq, 2, 0, 7)  # rows 2..8: positions 0..6 score tokens 1..7
    sampler = Sampler(VOCAB, [EOS])
    plan = SamplingPlanner(sampler).plan([seq, other], [span])
    picked = DeviceSampler(torch.device("cpu")).pick(torch.from_numpy(logits), plan)
    (scored,) = picked.prompt_samples(plan)
    want = logprobs_of(logits[2:9, :VOCAB], prompt[1:8], 4)
    assert len(scored) == 7
    for j, (g, w) in enumerate(zip(scored, want)):
        assert_same_sample(g, w, f"prompt position {j}")


def test_best_first_breaks_ties_by_the_lower_id() -> None:
    values = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 5.0, 1.0, 5.0, 5.0]])
    vals, ids = best_first(values, 4)
    assert ids.tolist() == [[1, 3, 2, 4], [0, 1, 2, 3]]
    assert vals.tolist() == [[3.0, 3.0, 2.0, 2.0], [5.0] * 4]


# ---- through the engine, on the tiny model ---------------------------------------------------------
def engine(model: Path, on_device: bool = True, **kw: object) -> LLMEngine:
    config = EngineConfig(num_blocks=64, device="cpu", **kw)  # type: ignore[arg-type]
    eng = LLMEngine(model, config, platform=TorchPlatform("cpu"))
    eng.executor.samples_on_device = on_device  # off: the logits to the host, the numpy sampler
    return eng


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    for key, (prompt, params) in requests.items():
        eng.add_request(key, prompt_token_ids=prompt, params=params)
    out: dict[str, dict] = {k: {"tokens": [], "logprobs": [], "prompt_logprobs": None} for k in requests}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id]["tokens"] += o.token_ids
            out[o.request_id]["logprobs"] += o.logprobs or []
            out[o.request_id]["prompt_logprobs"] = o.prompt_logprobs or out[o.request_id]["prompt_logprobs"]
    return out


ENGINE_REQUESTS = {
    "greedy": (list(range(5, 12)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    "seeded": (
        list(range(40, 77)),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    ),
    "top-k-logprobs": (
        [3, 9, 27, 81, 243, 729] * 4,
        SamplingParams(temperature=1.2, top_k=40, seed=8, logprobs=3, max_tokens=8, ignore_eos=True),
    ),
    "penalties": (
        list(range(100, 130)),
        SamplingParams(
            temperature=0.8,
            min_p=0.05,
            seed=9,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            logit_bias={17: 2.0},
            min_tokens=4,
            max_tokens=8,
        ),
    ),
    "prompt-logprobs": (
        list(range(60, 80)),
        SamplingParams(temperature=0, prompt_logprobs=2, logprobs=1, max_tokens=3),
    ),
    "choice": (
        list(range(200, 210)),
        SamplingParams(
            temperature=1.0,
            seed=10,
            max_tokens=16,
            guided={"kind": "choice", "spec": ["alpha beta", "gamma", "delta epsilon zeta"]},
        ),
    ),
}


def test_the_engine_samples_on_the_device_as_on_the_host(tiny_model_dir: Path) -> None:
    """The same requests (every kind of setting, seeded, a grammar) through the torch engine with
    the device sampler and with the logits copied to the host for the numpy sampler: the same
    forward, the same tokens and logprobs. (The tiny model's logits are not on a grid: with these
    fixed seeds no uniform falls within rounding of a boundary, which the unit test above proves
    by construction for its own logits.)"""
    device = run(engine(tiny_model_dir), ENGINE_REQUESTS)
    host = run(engine(tiny_model_dir, on_device=False), ENGINE_REQUESTS)
    for key in ENGINE_REQUESTS:
        assert device[key]["tokens"] == host[key]["tokens"], key
        for g, w in zip(device[key]["logprobs"], host[key]["logprobs"], strict=True):
            assert (g.token_id, g.rank, [t for t, _ in g.top_logprobs or []]) == (
                w.token_id,
                w.rank,
                [t for t, _ in w.top_logprobs or []],
            ), key
            assert g.logprob == pytest.approx(w.logprob, abs=1e-9)
    scored = device["prompt-logprobs"]["prompt_logprobs"]
    want = host["prompt-logprobs"]["prompt_logprobs"]
    assert len(scored) == len(want) == 20 and scored[0].logprob is None
    for g, w in zip(scored[1:], want[1:]):
        assert (g.token_id, g.rank, [t for t, _ in g.top_logprobs]) == (
            w.token_id,
            w.rank,
            [t for t, _ in w.top_logprobs],
        )
        assert g.logprob == pytest.approx(w.logprob, abs=1e-9)
    text = engine(tiny_model_dir).tokenizer.decode(device["choice"]["tokens"])
    assert text in ("alpha beta", "gamma", "delta epsilon zeta")


def test_each_step_overlaps_the_host_s_work_with_the_device_s(tiny_model_dir: Path) -> None:
    """Per step: the forward is launched; the plan is built (the host's sampling work, while a GPU
    runs the forward); the sampling is queued; the step's bookkeeping runs (computed tokens, the
    prefix cache's new blocks: no token of this step needed); only then are the ids collected. No
    [rows, vocab] logits reach the host."""
    eng = engine(tiny_model_dir)
    events: list[str] = []
    ex, planner = eng.executor, eng.picking.planner
    launch, sample, plan, computed = ex.launch, ex.sample, planner.plan, eng._computed

    def no_logits(step: object) -> None:
        raise AssertionError("the logits went to the host")

    def sampled(launched: object, p: object) -> object:
        events.append("sample")
        pending = sample(launched, p)  # type: ignore[arg-type]
        collect = pending.collect
        pending.collect = lambda: events.append("collect") or collect()  # type: ignore[method-assign]
        return pending

    ex.forward = no_logits  # type: ignore[method-assign]
    ex.launch = lambda step: events.append("launch") or launch(step)  # type: ignore[method-assign]
    ex.sample = sampled  # type: ignore[method-assign]
    planner.plan = lambda *a: events.append("plan") or plan(*a)  # type: ignore[method-assign]
    eng._computed = lambda batch: events.append("computed") or computed(batch)  # type: ignore[method-assign]
    out = run(eng, {"a": ENGINE_REQUESTS["seeded"], "b": ENGINE_REQUESTS["greedy"]})
    assert len(out["a"]["tokens"]) == 8
    step = ["launch", "plan", "sample", "computed", "collect"]
    assert events == step * (len(events) // len(step)) and len(events) >= 8 * len(step)


def test_seeded_requests_reproduce_and_continue_across_the_hand_off(tiny_model_dir: Path) -> None:
    """A seeded request gives the same tokens again; prefilled on one engine and decoded on another
    (which replays the first token, one draw, from its own generator), it gives the tokens of one
    engine doing both."""
    prompt, params = ENGINE_REQUESTS["seeded"]
    first = run(engine(tiny_model_dir), {"r": (prompt, params)})["r"]["tokens"]
    assert run(engine(tiny_model_dir), {"r": (prompt, params)})["r"]["tokens"] == first
    assert run(engine(tiny_model_dir), {"r": (prompt, params.replace(seed=70))})["r"]["tokens"] != first
    prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir)
    prefill.add_request("k", prompt_token_ids=prompt, params=params, prefill_only=True)
    out = None
    while out is None:
        out = next((o for o in prefill.step() if o.prefilled), None)
    decode.reserve("k", len(prompt))
    decode.import_kv("k", prefill.export_kv("k"))
    decode.add_prefilled("k", prompt, out.token_ids[0], params)
    tokens = list(out.token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.token_ids]
    assert tokens == first


# ---- the host's side of the step ------------------------------------------------------------------
def test_distinct_is_numpy_s_unique_with_counts() -> None:
    from pdserve.engine.sample_plan import distinct

    for ids in (np.zeros(0, np.int64), np.array([5]), np.random.default_rng(2).integers(0, 50, 300)):
        want = np.unique(ids, return_counts=True)
        got = distinct(ids)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_block_tables_are_kept_per_sequence_and_follow_a_new_list() -> None:
    """ModelRunner converts each sequence's block table once and then only what was appended; a
    sequence given a new list (preempted and readmitted, same length) gets its new blocks."""
    from pdserve.engine.model_runner import ModelRunner

    class Slots:
        block_size = 4

        def write_rows(self, slots: np.ndarray) -> np.ndarray:
            return slots

        def gather_chunks(self, table: np.ndarray) -> np.ndarray:
            raise AssertionError("the paged layout gathers nothing")

    runner = ModelRunner(Slots(), paged_kernel=True)  # type: ignore[arg-type]
    seq = Sequence("s", list(range(10)), SamplingParams())
    seq.block_table = [3, 4, 5]
    first = runner.block_table(seq)
    assert first.tolist() == [3, 4, 5]
    seq.block_table.extend([6, 7])
    assert runner.block_table(seq).tolist() == [3, 4, 5, 6, 7] and first.tolist() == [3, 4, 5]
    seq.block_table = [8, 9, 10, 11, 12]  # a new list of the same length
    assert runner.block_table(seq).tolist() == [8, 9, 10, 11, 12]
    seq.block_table = []
    assert runner.block_table(seq).tolist() == []
