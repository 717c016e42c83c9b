"""Prompts for the suite's workloads: the library factory (:mod:`kimi_perf.load.prompts`) with the
suite's policy for a missing dataset (a skip naming the setup command). Why a subclass and not the
library factory itself: the factory also serves the power study and the A/B runner outside pytest,
where a missing dataset is an error, not a skip."""

from __future__ import annotations

import pytest

from kimi_perf.load.prompts import PromptFactory as _LibraryFactory

from .models import TargetModel


class PromptFactory(_LibraryFactory):
    """The library's factory; a text dataset missing from the cache skips the test that needs it,
    with the setup command that fetches it."""

    def __init__(self, target: TargetModel) -> None:
        super().__init__(target.path)
        self.target = target

    def text_prompts(self, dataset: str) -> list[list[int]]:
        try:
            return super().text_prompts(dataset)
        except FileNotFoundError as e:
            pytest.skip(str(e))

    def conversation_turns(self, max_len: int) -> list[list[list[int]]]:
        try:
            return super().conversation_turns(max_len)
        except FileNotFoundError as e:
            pytest.skip(str(e))


