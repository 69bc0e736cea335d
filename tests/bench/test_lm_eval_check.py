"""`crossover bench lm-eval`'s pieces that run without lm-eval: the committed task is what its
script makes, lm-eval's context/continuation split, and the comparison that decides `passed`."""

from __future__ import annotations

import pytest

from bench import lm_eval_check
from bench.workloads import mc_task
from tests.engine.conftest import ByteTokenizer


def test_the_committed_task_is_what_its_script_makes() -> None:
    for name, text in mc_task.files().items():
        assert (mc_task.FOLDER / name).read_text() == text, f"run python -m bench.workloads.mc_task ({name})"
    items = mc_task.items()
    assert len(items) >= 50
    assert all(len(set(it["choices"])) == 4 and 0 <= it["answer"] < 4 for it in items)
    assert len({it["answer"] for it in items}) == 4  # the right answer is not always in one place


def test_encode_pair_moves_the_contexts_trailing_spaces_to_the_continuation() -> None:
    tok = ByteTokenizer()
    ctx, cont = lm_eval_check.encode_pair(tok, "Answer: ", "Paris")
    assert ctx == tok.encode("Answer:", add_bos=False) and cont == tok.encode(" Paris", add_bos=False)


def _samples(picks: list[int]) -> list[dict]:
    items = mc_task.items()
    out = []
    for i, (item, pick) in enumerate(zip(items, picks, strict=True)):
        lls = [-5.0] * 4
        lls[pick] = -1.0
        resps = [[[str(v), "False"]] for v in lls]
        out.append({"doc_id": i, "resps": resps, "acc": float(pick == item["answer"])})
    return out


def test_compare_passes_only_when_every_pick_and_the_accuracy_agree() -> None:
    items = mc_task.items()
    answers = [it["answer"] for it in items]
    direct = [[-1.0 if j == a else -5.0 for j in range(4)] for a in answers]
    summary = {"acc,none": 1.0, "acc_stderr,none": 0.0}
    same = lm_eval_check.compare(_samples(answers), summary, direct, 1.0, "m")
    assert same["passed"] and same["direct"]["acc"] == 1.0 and same["same_picks"] == len(items)
    assert same["max_abs_loglikelihood_diff"] == 0.0
    off = [(a + 1) % 4 if i == 0 else a for i, a in enumerate(answers)]
    differ = lm_eval_check.compare(_samples(off), {"acc,none": 1.0 - 1 / len(items)}, direct, 1.0, "m")
    assert not differ["passed"] and differ["same_picks"] == len(items) - 1
    assert differ["max_abs_loglikelihood_diff"] == 4.0


def test_the_command_names_a_missing_lm_eval(capsys) -> None:
    from cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "lm-eval", "--lm-eval", "/nowhere/lm_eval", "--url", "http://127.0.0.1:9"])
    assert done.value.code == 2 and "/nowhere/lm_eval" in capsys.readouterr().err
