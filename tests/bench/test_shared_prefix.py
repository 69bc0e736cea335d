"""The shared-prefix workload: 4 tenants, each prompt opens with its tenant's ~1,000-token system
prompt, different questions after it, the same prompts for the same seed."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.workloads import shared_prefix, system_prompts, to_request
from bench.workloads.shared import TENANTS
from engine.fake import FakeTokenizer
from engine.model.gguf_file import default_gguf_path
from engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path(progress=False), progress=False)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("which", ["gemma", "fake"])
def test_every_prompt_opens_with_its_tenants_1000_token_system_prompt(which, request):
    tok = request.getfixturevalue("gemma") if which == "gemma" else FakeTokenizer()
    got = shared_prefix(16, seed=0, tokenizer=tok)
    systems = system_prompts(seed=0, tokenizer=tok)
    assert len(systems) == TENANTS == 4
    assert Counter(p.tenant for p in got) == {t: 4 for t in systems}  # every tenant, evenly
    for text in systems.values():
        assert 950 <= len(tok.encode(text, add_bos=False)) <= 1000
    ids = {i: to_request(p, tok, f"r{i}", 8).prompt_ids for i, p in enumerate(got)}
    for i, p in enumerate(got):
        assert p.chat and p.messages[0] == ("system", systems[p.tenant])
        assert to_request(p, tok, "x", 8).tenant == p.tenant  # requests carry the tenant
        for j, q in enumerate(got[:i]):
            shared = common_prefix(ids[i], ids[j])
            if q.tenant == p.tenant:  # the whole system prompt (and the template) is shared
                assert shared >= 950, (i, j, shared)
            else:  # only the template's opening and maybe a module name's first word
                assert shared < 50, (i, j, shared)
            assert ids[i][shared:] and ids[j][shared:]  # they differ after it
    assert len({p.messages[1] for p in got}) == 16  # a different question each


def test_same_seed_same_prompts_other_seed_other_ones():
    tok = FakeTokenizer()
    assert shared_prefix(8, seed=3, tokenizer=tok) == shared_prefix(8, seed=3, tokenizer=tok)
    other = shared_prefix(8, seed=4, tokenizer=tok)
    assert other != shared_prefix(8, seed=3, tokenizer=tok)
    assert system_prompts(3, tok) != system_prompts(4, tok)  # the seed picks the system prompts


def test_prefix_tokens_and_tenants_size_the_workload():
    tok = FakeTokenizer()
    systems = system_prompts(0, tok, prefix_tokens=300, tenants=2)
    assert len(systems) == 2
    assert all(280 <= len(tok.encode(s, add_bos=False)) <= 300 for s in systems.values())
    no_tokenizer = system_prompts(0, None, prefix_tokens=300)  # 4 characters a token
    assert all(1100 <= len(s) <= 1200 for s in no_tokenizer.values())
    with pytest.raises(ValueError, match="must be >= 1"):
        system_prompts(0, tok, tenants=0)
