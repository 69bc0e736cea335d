"""Built-in traffic generator: stdlib-sourced prompts per kind, seeded draws, Poisson traces."""

from __future__ import annotations

import ast
import math
import shutil
import statistics
from collections import Counter

import pytest

from bench.workloads import (
    KINDS,
    SHIFTING_TRACE,
    Phase,
    Prompt,
    mixed,
    pool,
    prompts,
    shifting_trace,
    to_request,
    trace,
)
from bench.workloads.sources import load_modules, stdlib_dir

MIN_TOKENS, MAX_TOKENS, MOST_UNDER = 40, 600, 400


def _key(p: Prompt) -> object:
    return p.messages if p.chat else p.text


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_at_least_20_distinct_prompts(kind):
    got = prompts(kind, 20, seed=0)
    assert [p.kind for p in got] == [kind] * 20
    assert len({_key(p) for p in got}) == 20
    assert len(pool(kind)) >= 20


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_prompts_other_seed_other_prompts(kind):
    assert prompts(kind, 20, seed=7) == prompts(kind, 20, seed=7)
    assert prompts(kind, 20, seed=7) != prompts(kind, 20, seed=8)


def test_asking_for_more_than_the_pool_reshuffles_after_using_every_prompt():
    items = pool("prose")
    got = prompts("prose", len(items) + 5, seed=3)
    assert len({_key(p) for p in got[: len(items)]}) == len(items)
    assert len(got) == len(items) + 5


@pytest.mark.parametrize("kind", KINDS)
def test_every_prompt_encodes_within_the_length_range(tok, kind):
    lengths = sorted(len(tok.encode(p.render(tok))) for p in pool(kind))
    assert MIN_TOKENS <= lengths[0] and lengths[-1] <= MAX_TOKENS, (lengths[0], lengths[-1])
    assert lengths[int(0.9 * len(lengths))] <= MOST_UNDER


def test_copy_prompts_quote_a_verbatim_stdlib_block():
    files: dict[str, str] = {}
    for p in pool("copy"):
        path = p.source.split(":")[0]
        text = files.setdefault(path, (stdlib_dir() / path).read_text(encoding="utf-8"))
        assert len(p.quote) >= 200
        assert p.quote in p.text, p.source
        assert p.quote in text, p.source
        assert p.max_tokens >= 32


def test_code_prompts_are_a_real_function_cut_mid_body():
    trees: dict[str, tuple[list[str], ast.Module]] = {}
    for p in prompts("code", 40, seed=0):
        path, qualname = p.source.split(":")
        if path not in trees:
            text = (stdlib_dir() / path).read_text(encoding="utf-8")
            trees[path] = (text.split("\n"), ast.parse(text))
        lines, tree = trees[path]
        node = _find(tree, qualname)
        full = "\n".join(lines[node.lineno - 1:node.end_lineno]).strip()
        prefix = p.text.removeprefix(f"class {qualname.split('.')[0]}:\n").strip()
        assert full.startswith(prefix), p.source
        assert len(prefix) < len(full), p.source
        assert ast.get_docstring(node) is not None


def _find(tree: ast.Module, qualname: str) -> ast.AST:
    scope: list[ast.stmt] = tree.body
    for part in qualname.split("."):
        node = next(n for n in scope if getattr(n, "name", None) == part)
        scope = getattr(node, "body", [])
    return node


def test_chat_prompts_render_as_gemma_turns(tok):
    for p in prompts("chat", 30, seed=0):
        rendered = p.render(tok)
        assert p.chat and p.messages[-1] == ("user", p.text)
        assert rendered.startswith("<start_of_turn>user\n")
        assert rendered.endswith("<start_of_turn>model\n")
    roles = {tuple(r for r, _ in p.messages) for p in pool("chat")}
    assert ("user", "assistant", "user") in {r[-3:] for r in roles}, "some chats have a follow-up turn"
    assert any(r[0] == "system" for r in roles)


def test_prose_prompts_stop_at_a_sentence_end_and_are_not_chat():
    for p in pool("prose"):
        assert not p.chat and p.text.rstrip()[-1] in ".!?"
        assert ">>>" not in p.text


def test_to_request_encodes_with_bos_and_names_the_tenant(tok):
    copy, chat = prompts("copy", 1, seed=0)[0], prompts("chat", 1, seed=0)[0]
    r = to_request(copy, tok, "r1")
    assert r.prompt_ids == tok.encode(copy.text, add_bos=True)
    assert (r.request_id, r.tenant, r.sampling.max_tokens) == ("r1", "copy-tenant", copy.max_tokens)
    r = to_request(chat, tok, "r2", max_tokens=5, temperature=0.7, seed=11)
    assert r.prompt_ids[0] == tok.bos_id and tok.start_of_turn_id in r.prompt_ids
    assert (r.tenant, r.sampling.max_tokens, r.sampling.temperature,
            r.sampling.seed) == ("chat-tenant", 5, 0.7, 11)


def test_mixed_follows_the_weights_and_is_seeded():
    got = mixed(400, {"copy": 3.0, "prose": 1.0, "chat": 0.0}, seed=1)
    counts = Counter(p.kind for p in got)
    assert set(counts) == {"copy", "prose"}
    assert abs(counts["copy"] - 300) < 5 * math.sqrt(400 * 0.75 * 0.25)
    assert got == mixed(400, {"copy": 3.0, "prose": 1.0, "chat": 0.0}, seed=1)
    assert got != mixed(400, {"copy": 3.0, "prose": 1.0, "chat": 0.0}, seed=2)


@pytest.mark.parametrize("mix", [{"poetry": 1.0}, {"copy": -1.0}, {"copy": 0.0}, {"copy": math.nan}])
def test_bad_mixes_are_refused(mix):
    with pytest.raises(ValueError):
        mixed(3, mix, seed=0)
    with pytest.raises(ValueError):
        Phase(1.0, 1.0, mix)


@pytest.mark.parametrize("kwargs", [{"duration_s": 0.0}, {"rate_per_s": -1.0}, {"max_concurrency": 0}])
def test_bad_phases_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Phase(**{"duration_s": 1.0, "rate_per_s": 1.0, **kwargs})


PHASES = [Phase(100.0, 2.0, {"copy": 1.0}), Phase(20.0, 0.0),
          Phase(50.0, 8.0, {"chat": 1.0, "prose": 1.0}, 4)]


def test_trace_arrivals_are_sorted_within_their_phase_and_poisson_plausible():
    windows = [(0.0, 100.0), (100.0, 120.0), (120.0, 170.0)]
    per_phase: list[list[int]] = [[], [], []]
    for seed in range(10):
        t = trace(PHASES, seed)
        times = [a.at_s for a in t]
        assert times == sorted(times)
        for a in t:
            lo, hi = windows[a.phase]
            assert lo <= a.at_s < hi
            assert a.tenant == f"{a.prompt.kind}-tenant"
            assert a.prompt.kind in PHASES[a.phase].mix
        for i, rows in enumerate(per_phase):
            rows.append(sum(a.phase == i for a in t))
    for phase, counts in zip(PHASES, per_phase):
        expected = phase.rate_per_s * phase.duration_s
        assert all(abs(c - expected) <= 5 * math.sqrt(expected) for c in counts), (expected, counts)
        assert abs(statistics.mean(counts) - expected) <= 4 * math.sqrt(expected / len(counts)) + 1e-9


def test_trace_is_seeded():
    assert trace(PHASES, 4) == trace(PHASES, 4)
    assert trace(PHASES, 4) != trace(PHASES, 5)


def test_shifting_trace_goes_copy_heavy_then_mixed_then_prose():
    low_copy, high_mixed, low_prose = SHIFTING_TRACE
    assert max(low_copy.mix, key=low_copy.mix.get) == "copy"
    assert set(high_mixed.mix) == set(KINDS) and high_mixed.rate_per_s > low_copy.rate_per_s
    assert max(low_prose.mix, key=low_prose.mix.get) == "prose"
    t = trace(shifting_trace(phase_s=60.0, low_rate=1.0, high_rate=4.0), seed=0)
    first = Counter(a.prompt.kind for a in t if a.phase == 0)
    assert first.most_common(1)[0][0] == "copy"
    assert sum(a.phase == 1 for a in t) > 2 * sum(a.phase == 0 for a in t)


def test_missing_and_broken_stdlib_files_are_skipped(tmp_path):
    shutil.copy(stdlib_dir() / "textwrap.py", tmp_path / "textwrap.py")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("def broken(:\n", encoding="utf-8")
    (tmp_path / "difflib.py").write_bytes(b"\xff\xfe not utf-8")
    modules = load_modules(str(tmp_path))
    assert [m.name for m in modules] == ["textwrap"]
    assert modules[0].text == (tmp_path / "textwrap.py").read_text(encoding="utf-8")
