"""summary.md: one alignment table per comparison, not one per layer (each with its own header)."""

from __future__ import annotations

from kimi_perf.report import merge_markdown_tables

HDR = "| layer | cos min | ok |\n|---|---|---|"


def test_blocks_of_one_comparison_become_one_table():
    blocks = [f"**hf [bf16] vs server [bf16]**\n\n{HDR}\n| {k} | 0.99 | yes |" for k in (2, 15, 27)]
    blocks.insert(1, f"**vllm vs hf**\n\n{HDR}\n| 2 | 0.98 | yes |\n\n- vllm: its ids are entering layers")
    blocks.append(f"**vllm vs hf**\n\n{HDR}\n| 15 | 0.97 | yes |\n\n- vllm: its ids are entering layers")
    md = "\n".join(merge_markdown_tables(blocks))
    assert md.count("| layer | cos min | ok |") == 2
    assert md.count("**hf [bf16] vs server [bf16]**") == 1 and md.count("- vllm: its ids are entering layers") == 1
    first = md.split("**vllm vs hf**")[0]
    assert [ln for ln in first.splitlines() if ln.startswith("| ") and "layer" not in ln] == [
        "| 2 | 0.99 | yes |", "| 15 | 0.99 | yes |", "| 27 | 0.99 | yes |"]
    # a table always ends with a blank line before the next title
    assert "| 27 | 0.99 | yes |\n\n**vllm vs hf**" in md


def test_non_table_blocks_pass_through_once():
    assert merge_markdown_tables(["just a note", "just a note"]) == ["just a note", ""]
