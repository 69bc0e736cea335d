"""FakeEngine: the hand-checkable behaviour the daemon tests rely on."""

from __future__ import annotations

import pytest

from engine.fake import BOS_ID, EOS_ID, FakeEngine, FakeTokenizer, fake_logprob
from engine.types import Request, SamplingParams, StepOutput, TokenEvent

TOK = FakeTokenizer()


def run(engine: FakeEngine, max_steps: int = 1000) -> tuple[list[TokenEvent], list[StepOutput]]:
    events: list[TokenEvent] = []
    outs: list[StepOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return events, outs
        out = engine.step()
        outs.append(out)
        events.extend(out.events)
    raise AssertionError("engine did not finish")


def req(rid: str, prompt: str, **sampling: object) -> Request:
    return Request(rid, TOK.encode(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]


def text_of(events: list[TokenEvent], rid: str) -> str:
    return "".join(e.text for e in events if e.request_id == rid)


def test_tokenizer_round_trip_and_template() -> None:
    assert TOK.encode("ab") == [BOS_ID, ord("a") + 16, ord("b") + 16]
    assert TOK.decode(TOK.encode("héllo")) == "héllo"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert TOK.apply_chat_template(msgs) == "system: s\nuser: hi\nassistant: "
    with pytest.raises(ValueError, match="role"):
        TOK.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_output_is_reversed_prompt_then_eos() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "abc", max_tokens=16))
    events, outs = run(engine)
    assert [e.token_ids for e in events] == [(ord("c") + 16,), (ord("b") + 16,), (ord("a") + 16,), (EOS_ID,)]
    assert text_of(events, "a") == "cba"
    assert events[-1].finished and events[-1].finish_reason == "stop"
    [result] = [r for o in outs for r in o.finished]
    assert (result.prompt_tokens, result.output_tokens, result.finish_reason) == (4, 4, "stop")


def test_max_tokens_gives_length() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "abcdef", max_tokens=2))
    events, _ = run(engine)
    assert text_of(events, "a") == "fe"
    assert len(events) == 2 and events[-1].finish_reason == "length"


def test_stop_string_cuts_text_and_holds_back_prefixes() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "xxcbayz", max_tokens=50, stop=("ab",)))
    events, _ = run(engine)
    # reversed: "zyabcxx" -> cut before "ab"; "a" was held back, never sent
    assert text_of(events, "a") == "zy"
    assert all("a" not in e.text for e in events)
    assert events[-1].finish_reason == "stop"


def test_stop_string_that_never_matches_flushes_held_text() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "abc", max_tokens=50, stop=("aX",)))
    events, _ = run(engine)
    assert text_of(events, "a") == "cba"


def test_stop_token_ids_and_ignore_eos() -> None:
    engine = FakeEngine()
    engine.add_request(req("s", "abc", stop_token_ids=(ord("b") + 16,)))
    engine.add_request(req("r", "ab", max_tokens=5, ignore_eos=True))
    events, _ = run(engine)
    finals = {e.request_id: e.finish_reason for e in events if e.finished}
    assert text_of(events, "s") == "c" and finals["s"] == "stop"
    assert text_of(events, "r") == "babab" and finals["r"] == "length"


def test_multibyte_text_arrives_as_whole_characters() -> None:
    engine = FakeEngine()
    engine.add_request(req("u", "hé€", max_tokens=50))
    events, _ = run(engine)
    texts = [e.text for e in events]
    assert "".join(texts) == "€éh"
    assert texts.count("") >= 3  # the incomplete bytes of é and € emit nothing
    assert len(events) == len(TOK.encode("hé€", add_bos=False)) + 1


def test_logprobs_follow_fake_logprob() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "abcde", logprobs=True))
    events, _ = run(engine)
    assert [e.logprobs for e in events] == [(fake_logprob(i),) for i in range(6)]


def test_max_batch_queue_pages_and_stats() -> None:
    engine = FakeEngine(max_batch=2, page_size=4)
    for i in range(5):
        engine.add_request(req(f"r{i}", "abcdefg", max_tokens=8))
    first = engine.step()
    assert first.stats is not None
    assert first.stats.batch_size == 2 and first.stats.queue_len == 3
    assert engine.pages_used == 2 * 4  # ceil((8 + 8) / 4) each
    _, outs = run(engine)
    stats = [o.stats for o in outs if o.stats is not None]
    assert max(s.batch_size for s in stats) == 2
    assert len([r for o in [first, *outs] for r in o.finished]) == 5
    assert engine.pages_used == 0 and engine.status()["kv_pages_used"] == 0


def test_abort_running_and_waiting() -> None:
    engine = FakeEngine(max_batch=1)
    engine.add_request(req("run", "abcdef"))
    engine.add_request(req("wait", "abcdef"))
    engine.step()
    engine.abort("run")
    engine.abort("wait")
    engine.abort("unknown")
    out = engine.step()
    reasons = {e.request_id: e.finish_reason for e in out.events if e.finished}
    assert reasons == {"run": "abort", "wait": "abort"}
    assert {r.request_id: r.finish_reason for r in out.finished} == reasons
    assert engine.pages_used == 0 and not engine.has_work()


@pytest.mark.parametrize(
    "request_,match",
    [
        (Request("e", []), "empty"),
        (Request("v", [99999]), "token ids"),
        (Request("c", TOK.encode("x" * 10), SamplingParams(max_tokens=60)), "exceeds the context of 64"),
        (Request("t", [5], SamplingParams(top_p=0.0)), "top_p"),
    ],
)
def test_add_request_rejects(request_: Request, match: str) -> None:
    engine = FakeEngine(max_context=64)
    with pytest.raises(ValueError, match=match):
        engine.add_request(request_)
    assert not engine.has_work()


def test_duplicate_request_id_rejected_until_finished() -> None:
    engine = FakeEngine()
    engine.add_request(req("a", "x"))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(req("a", "x"))
    run(engine)
    engine.add_request(req("a", "x"))  # finished ids may be reused


def test_capacity_and_policy_follow_the_real_engines_surface() -> None:
    from engine.fake import FakeProposer
    from engine.policy import NEVER, BatchRule, TunedPolicy

    engine = FakeEngine(max_batch=8, num_pages=100, page_size=8, max_depth=3,
                        proposers={"mtp": FakeProposer("mtp", resident=1 << 20, per_draft=64,
                                                       max_depth=2, draft_vocabs=(512,))})
    cap = engine.capacity()
    assert (cap.total_pages, cap.usable_pages, cap.page_size, cap.max_depth) == (100, 100, 8, 3)
    assert (cap.max_batch, cap.spec_max_batch) == (8, 8)
    mtp = cap.proposers["mtp"]
    assert (mtp.resident_bytes, mtp.bytes_per_draft, mtp.max_depth, mtp.draft_vocabs) == (
        1 << 20, 64, 2, (512,))
    policy = TunedPolicy((BatchRule(8, "mtp", 2),), crossover=8, version=5)
    engine.set_policy(policy)
    assert engine.policy is NEVER  # until the next step, as in EngineCore
    engine.add_request(req("a", "hello"))
    engine.step()
    assert engine.policy is policy and engine.status()["policy_version"] == 5


def test_speculation_counts_only_the_tokens_a_request_keeps() -> None:
    """As EngineCore: drafts accepted past max_tokens are cut_tokens, not goodput."""
    from engine.fake import FakeProposer
    from engine.policy import BatchRule, TunedPolicy

    engine = FakeEngine(max_depth=3, proposers={"ngram": FakeProposer("ngram", (1.0,))})
    engine.set_policy(TunedPolicy((BatchRule(8, "ngram", 3),), crossover=8, version=1))
    engine.add_request(req("a", "abcdefgh", max_tokens=6))  # steps of 1 + 3 tokens: 4, then 2 of 4
    events, outs = run(engine)
    stats = [o.stats for o in outs if o.stats is not None]
    assert [s.decode_tokens for s in stats] == [len(e.token_ids) for e in events] == [4, 2]
    assert [(s.accepted, s.accepted_per_pos, s.cut_tokens) for s in stats] == [(3, (1, 1, 1), 0),
                                                                               (1, (1, 0, 0), 2)]
    assert [c.accepted for s in stats for c in s.row_classes] == [3, 1]
    (result,) = [r for o in outs for r in o.finished]
    assert (result.output_tokens, result.proposed_tokens, result.accepted_tokens) == (6, 6, 4)
