"""The drafter's code prompts (``eagle3.eval.code_prompts``): HumanEval tasks in task order, chat
templated like every held-out prompt, or the fetch command when the data is not there -- a reason the
code-prompt test reports, while the MT-bench tests of the same drafter run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_engine_alignment_plan import CPU, eagle3, session

from kimi_perf.suite.drafters import code_prompts


class Tok:
    """Stands in for the target's tokenizer: the chat template's text, one id per character."""

    def apply_chat_template(self, msgs, tokenize=True, add_generation_prompt=True, **kw):
        text = "".join(f"<{m['role']}>{m['content']}" for m in msgs) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text] if tokenize else text


def _profile(n):
    return replace(CPU, eagle3=replace(CPU.eagle3, eval=replace(CPU.eagle3.eval, code_prompts=n)))


def test_code_prompts_are_humaneval_tasks_in_order_or_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path))
    s = eagle3(session(_profile(2)))
    prompts, why = code_prompts(s, Tok())
    assert prompts == () and "python -m kimi_perf.data fetch --humaneval" in why and "code_prompts is 2" in why
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "humaneval_prompts.jsonl").write_text("".join(
        json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n" for i in range(3)))
    prompts, why = code_prompts(s, Tok())
    assert why == "" and len(prompts) == 2
    text = "".join(map(chr, prompts[1]))
    assert text.startswith("<user>Complete the following Python function.") and "def f1():" in text
    assert text.endswith("<assistant>")
    assert code_prompts(eagle3(session(_profile(0))), Tok()) == ((), "")
    with pytest.raises(pytest.UsageError, match="code_prompts is 4 but HumanEval has 3 tasks; set it to 3"):
        code_prompts(eagle3(session(_profile(4))), Tok())
